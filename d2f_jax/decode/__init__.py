"""Decoding: D2F pipelined block decoding and its baselines, each one jitted `lax.while_loop`.

    from d2f_jax.decode import DecodeConfig, generate
    result = generate(model, [[1, 2, 3]], DecodeConfig(block_size=32, max_new_tokens=256))
    result.to_lists()

On a mesh: `generate(model.shard(mesh), ...)` (or `mesh=`); `decode_program` compiles the loop ahead of time.
"""

from d2f_jax.decode.config import DecodeConfig, DecodeSpec, Knobs, resolve
from d2f_jax.decode.config_checks import DREAM_ALGS
from d2f_jax.decode.methods import METHODS
from d2f_jax.decode.mesh import DecodeMesh
from d2f_jax.decode.result import DecodeResult
from d2f_jax.decode.runner import (DecodeProgram, StreamChunk, decode_program, generate,
                                   generate_stepwise, pack_prompts, shard_model, stream, trace_count,
                                   with_attention)

__all__ = [
    "DREAM_ALGS", "METHODS", "DecodeConfig", "DecodeSpec", "Knobs", "resolve", "DecodeResult",
    "StreamChunk", "generate", "generate_stepwise", "pack_prompts", "stream", "trace_count", "DecodeMesh",
    "DecodeProgram", "decode_program", "shard_model", "with_attention",
]
