"""shardfit: FSDP2 training of large language models that fits more, runs faster and explains its memory.

`shardfit.Engine` is the in-process RL API (Tinker's datums, rl/step.py DatumEngine) on the one step path of
`shardfit.engine.Engine` (packed batches and an engine loss, engine/engine.py); importing the
package itself stays cheap (torch is imported when Engine is first touched).

This file also answers, for the config's training defaults, the two questions config cannot answer itself (it
imports nothing above errors/fsutil; config/defaults.py): the model's parameter count (models/) and whether the data
holds fine-tuning examples (data/). Python runs it before any shardfit module, so a config loaded by any caller has
its answers; the packages are imported when first asked (torch with models/)."""

from shardfit.config.defaults import ANSWERS as _ANSWERS

__version__ = "0.1.0"


def _param_count(model_cfg) -> int:
    from shardfit.models import param_count

    return param_count(model_cfg)


def _holds_examples(data_cfg) -> bool:
    from shardfit.data.mode import holds_examples

    return holds_examples(data_cfg)


_ANSWERS.param_count, _ANSWERS.holds_examples = _param_count, _holds_examples


def __getattr__(name: str):
    if name == "Engine":
        from shardfit.rl import DatumEngine

        return DatumEngine
    raise AttributeError(f"module 'shardfit' has no attribute {name!r}")
