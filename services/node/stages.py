"""Layer stages (λScale's execution pipelines, CoCoServe's module replication and migration): the
old import path, kept as a thin re-export while its importers move. The parts live in
services/node/engines/, one job each:

    weights.py        a checkpoint's tensors by layer, a model holding only some layers
    stage_wire.py     the link's message framing, and K/V in and out of a paged cache
    stage_client.py   an engine's link to a stage
    stage_server.py   the stage process (`python -m services.node.engines.stage_server`)
    split.py          a split instance: which layers run where, one forward pass across them

`python -m services.node.stages ...` still runs a stage.
"""

from __future__ import annotations

import sys

from services.node.engines.split import Layout, Split  # noqa: F401
from services.node.engines.stage_client import StageClient  # noqa: F401
from services.node.engines.stage_server import (LayerStage, StageProcess, StageServer,  # noqa: F401
                                                main, serve, spawn_stage)
from services.node.engines.stage_wire import (StageError, export_kv, import_kv,  # noqa: F401
                                              recv_message, send_message)
from services.node.engines.weights import (assign_layers, drop_layers, held_tensors,  # noqa: F401
                                           holding_of, layer_of, partial_model, read_tensors,
                                           weight_bytes)

if __name__ == "__main__":
    sys.exit(main())
