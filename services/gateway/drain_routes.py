"""Operator route that drains a node: `POST /admin/nodes/{node_id}/drain`.

The node marks itself draining (its view says so, and placers send it no new work), then moves
each of its requests live to another node (token-based multi-round migration, see
shared/core/migration.py). A request no other node takes finishes where it is: a drain never
loses a request. The reply comes once the node has started draining, not when it is empty.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.gateway import errors
from services.gateway.deps import Caller, Context
from services.gateway.openapi_docs import ADMIN_ERRORS
from shared import wire
from shared.schemas import CommandKind, NodeCommand, NodeReply
from shared.subjects import node_command_subject

router = APIRouter(prefix="/admin", responses=ADMIN_ERRORS)
DRAIN_TIMEOUT_S = 5.0


@router.post("/nodes/{node_id}/drain", response_model=None)
async def drain_node(node_id: str, caller: Caller, ctx: Context) -> dict[str, Any]:
    if not caller.operator:
        raise errors.APIError(403, "Only the operator may drain a node.", type="permission_error",
                              code="permission_denied")
    try:
        msg = await ctx.nc.request(node_command_subject(node_id),
                                   wire.encode(NodeCommand(CommandKind.DRAIN)), timeout=DRAIN_TIMEOUT_S)
        reply = wire.decode(NodeReply, msg.data)
    except Exception:  # no responders, timeout: the node is not there (or not answering)
        raise errors.APIError(404, f"Node {node_id!r} did not answer.", param="node_id",
                              code="node_not_found") from None
    return {"object": "node.drain", "node_id": node_id, "draining": reply.accepted,
            "requests": reply.generated}
