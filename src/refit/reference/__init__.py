"""The reference rollout engine: a small, real CPU inference engine refit is tested against.

refit.reference.model    the trainer's tiny HF-named model and the math both sides share
refit.reference.engine   the engine core (fused weights, prefix KV cache, scheduler, sessions)
refit.reference.server   the engine's main loop behind a channel (process pipe or thread)
refit.reference.client   trainer-side handle: calls with deadlines, engine death detection
"""
