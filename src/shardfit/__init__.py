"""shardfit: FSDP2 training of large language models that fits more, runs faster and explains its memory.

`shardfit.Engine` is the in-process step API (engine/engine.py; the RL API on it in shardfit.rl); importing the
package itself stays cheap (torch is imported when Engine is first touched)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from shardfit.engine import Engine

        return Engine
    raise AttributeError(f"module 'shardfit' has no attribute {name!r}")
