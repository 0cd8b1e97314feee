"""SLINFER's policy core: pure functions and plain state machines, shared by the placer, the node
worker and the cluster simulator.

Rules of this package (tests/core/test_purity.py enforces the import rule): no torch, nats, redis,
fastapi, asyncio, openvino or vllm; no wall clock (time is always an argument); no module state
(randomness is a seeded `random.Random` passed in). A decision seen in a simulation is the decision
the service makes, because both call the same functions.
"""
