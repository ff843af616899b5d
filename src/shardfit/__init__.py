"""shardfit: FSDP2 training of large language models that fits more, runs faster and explains its memory.

`shardfit.Engine` is the in-process step API (train/engine.py; the RL data model in shardfit.rl); importing the
package itself stays cheap (torch is imported when Engine is first touched)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from shardfit.train.engine import Engine

        return Engine
    raise AttributeError(f"module 'shardfit' has no attribute {name!r}")
