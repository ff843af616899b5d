"""shardfit: FSDP2 training of large language models that fits more, runs faster and explains its memory.

`shardfit.Engine` is the in-process RL API (Tinker's datums, rl/step.py DatumEngine) on the one step path of
`shardfit.engine.Engine` (packed batches and an engine loss, engine/engine.py); importing the
package itself stays cheap (torch is imported when Engine is first touched)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from shardfit.rl import DatumEngine

        return DatumEngine
    raise AttributeError(f"module 'shardfit' has no attribute {name!r}")
