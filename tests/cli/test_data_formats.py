"""Issue 27, "the data people have" and "steps only", as a user meets them: `python -m shardfit train` in a
subprocess on the embedded tiny model. The same examples written as ShareGPT, Alpaca and conversational
prompt/completion train to the very losses of their hand-converted `messages`; the header names the format, the chat
template and what truncation cut; `shardfit generate` applies the template the run recorded; train.epochs gives the
step count of its passes, and a resumed run derives the same."""

import json

import pytest

from shardfit.config import load_config
from tests.cli.test_cli import TINY, _run

# (system or "", instruction, input or "", output): single-turn examples every layout can write; the last two are
# longer than data.seq_len=64 (cut, but kept: their answers start within it)
EXAMPLES = [("", "add", "2 3", "5"), ("be terse", "greet", "", "hi"), ("", "negate", "yes", "no"),
            ("", "echo", "abc", "abc"), ("you count", "next", "7", "8"), ("", "upper", "q", "Q"),
            ("", "copy", "x", "y" * 40), ("", "copy", "z", "w" * 60)]


def _messages(system, instruction, inp, output):
    user = instruction + (f"\n\n{inp}" if inp else "")
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _record(layout, ex):
    system, instruction, inp, output = ex
    msgs = _messages(*ex)
    if layout == "messages":
        return {"messages": msgs}
    if layout == "sharegpt":  # the system turn as ShareGPT sets write it: a top-level key, or a first turn
        speaker = {"system": "system", "user": "human", "assistant": "gpt"}
        turns = [{"from": speaker[m["role"]], "value": m["content"]} for m in msgs if m["role"] != "system"]
        return {"conversations": turns, "system": system} if system != "you count" else {
            "conversations": [{"from": "system", "value": system}, *turns]}
    if layout == "alpaca":
        return {"instruction": instruction, "input": inp, "output": output, **({"system": system} if system else {})}
    return {"prompt": msgs[:-1], "completion": msgs[-1:]}  # TRL's conversational prompt/completion


def _train_argv(tmp_path, name, rows, *extra, steps=3):
    """(argv after `shardfit`, run directory) of a run on `rows` written as tmp_path/name.jsonl."""
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / f"run_{name}"
    return ["train", *TINY, f"--data.path={data}", *([f"--train.steps={steps}"] if steps else []),
            f"--logging.run_dir={run}", "--checkpoint.final=false", "--logging.progress=lines", "--data.seq_len=64",
            *extra], run


def _finished(p, run):
    assert p.returncode == 0, p.stderr
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    return p.stdout, losses, run


def _train(tmp_path, name, rows, *extra, steps=3):
    argv, run = _train_argv(tmp_path, name, rows, *extra, steps=steps)
    return _finished(_run(*argv), run)


LAYOUTS = ["sharegpt", "alpaca", "prompt_completion"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """layout -> (stdout, losses, run directory) of the examples written as `messages` and as each of LAYOUTS, the
    four runs in one driver process (tests/cli/session.py; the interpreter and torch started once); their data files
    lie in one directory, the fixture's."""
    from tests.cli.session import run_commands

    root = tmp_path_factory.mktemp("layouts")
    made = {name: _train_argv(root, name, [_record(name, e) for e in EXAMPLES]) for name in ["messages", *LAYOUTS]}
    done = run_commands([argv for argv, _ in made.values()], cwd=root)
    return {name: _finished(p, run) for (name, (_, run)), p in zip(made.items(), done)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_trains_as_its_messages(layout_runs, layout):
    out, losses, run = layout_runs[layout]
    want_out, want, _ = layout_runs["messages"]
    assert losses == want and len(losses) == 3  # the same tokens and masks: bit-identical losses
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("data: "))
    assert head.startswith(f"data: {layout} (detected from {run.parent / layout}.jsonl:1), chat template: "
                           "shardfit's plain template (<|role|>\\n...); 8 training examples"), head
    assert head.endswith("at data.seq_len=64 (cut: 2 of 8 examples, 36 of 421 tokens)"), head
    assert ("warning: truncation cuts 2 of 8 training examples (25%) at data.seq_len=64, losing 36 tokens; fix: "
            "--data.seq_len=88 keeps 95% of them whole") in lines
    assert "data: messages (detected from" in want_out and head.split(";")[1] in want_out  # the same counts
    assert load_config(run / "config.toml").data.chat_template == "plain"  # the record generate reads


def test_generate_applies_the_template_the_run_recorded(tmp_path, capsys):
    """A run on ShareGPT (plain template, byte tokenizer): generate on its checkpoint and on its export sends the
    prompt in that template and says so; --raw does not; a pretraining run's checkpoint gets the text as it is."""
    from shardfit.cli.generate import generate

    export = tmp_path / "export"
    _, _, run = _train(tmp_path, "chat", [_record("sharegpt", e) for e in EXAMPLES], "--checkpoint.final=true",
                       f"--checkpoint.export_hf={export}", "--checkpoint.export_dtype=float32", steps=2)
    assert (export / "chat_template.jinja").is_file()
    args = ["--prompt", "add\n\n2 3", "--max-new-tokens", "4", "--device", "cpu"]
    answers = []
    for source in (["--checkpoint", str(run)], ["--model.path", str(export)]):
        capsys.readouterr()
        assert generate([*source, *args]) == 0
        got = capsys.readouterr()
        assert got.err.count("\n") == 1 and "in the chat template the model was fine-tuned with, shardfit's plain " \
                                               "template" in got.err, got.err
        answers.append(got.out)
    assert answers[0] == answers[1]  # the same weights, the same prompt tokens
    assert generate(["--checkpoint", str(run), *args, "--raw"]) == 0
    assert "chat template" not in capsys.readouterr().err


def test_epochs_give_the_steps_of_their_passes_and_resume(tmp_path):
    """6 examples one per row, 4 a step: 1 epoch is ceil(6/4) = 2 steps; continuing to 2 epochs resumes at step 3
    of ceil(12/4) = 3, deriving the same steps from the same data."""
    rows = [_record("messages", e) for e in EXAMPLES[:6]]
    extra = ("--data.pack=false", "--checkpoint.final=true")
    out, losses, run = _train(tmp_path, "ep", rows, *extra, "--train.epochs=1", steps=None)
    assert len(losses) == 2 and "step 2/2" in out
    assert "schedule: 2 steps x 4 examples = 1.33 passes over the training set's 6 examples (train.epochs=1)" in out
    saved = (run / "config.toml").read_text()
    assert saved.startswith("# train.steps = 2: train.epochs = 1 over 6 examples a pass")
    assert load_config(run / "config.toml").train.steps == 2  # the resolved run loads as steps, epochs 0
    out, losses, _ = _train(tmp_path, "ep", rows, *extra, "--train.epochs=2", "--checkpoint.allow_changes=train.epochs",
                            steps=None)  # a longer schedule continues the run only when asked (train/run_config.py)
    assert "resumed from" in out and "step 3/3" in out and len(losses) == 3


def test_steps_and_epochs_together_are_one_error(tmp_path):
    p = _run("train", *TINY, "--train.steps=5", "--train.epochs=2", f"--logging.run_dir={tmp_path}")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0] == ("shardfit: error: --train.epochs: train.steps=5 and train.epochs=2 are both given; fix: keep "
                        "one: train.epochs passes over the data, or train.steps optimizer steps")
