"""KTO's data: examples labelled desirable or not, each with the mismatched sequence its KL reference point reads, for
`shardfit train` with preference.objective=kto (train/preference.py).

  {"prompt": str, "completion": str, "label": bool}              TRL's unpaired preference: prompt + completion + EOS,
                                                                 trained on completion + EOS
  {"prompt": [msgs], "completion": [msgs], "label": bool}        a chat of prompt then completion (the template)
  a preference record ({"prompt"?, "chosen", "rejected"})        two examples, chosen desirable and rejected not
                                                                 (TRL's unpair_preference_dataset)

KTO's reference point z is the policy's KL from the reference, estimated on mismatched (prompt, completion)
sequences: TRL pairs each prompt with the completion of the example before it in its (unshuffled) batch of
per_device_train_batch_size. Here the rotation is over the whole training set, in file order, fixed once: example i's
KL sequence is prompt i + completion i-1 (the last example's for the first). Fixed sequences have fixed reference
log-probs, computed once with the examples' (a full fine-tune has no reference model to ask per step). A prompt is
an example's tokens before its first trained one; the completion, the rest (TRL's prompt_ids / completion_ids).
Torch-free.
"""

from __future__ import annotations

import numpy as np

from shardfit.data.formats import detect
from shardfit.data.messages import check_messages, json_type
from shardfit.data.preference import PreferencePairs, Sequence, pair_pieces
from shardfit.data.sft import Truncation
from shardfit.errors import ShardfitError


def unpaired_pieces(obj: object, where: str) -> list[tuple[list, bool, bool]]:
    """[(pieces or messages, chat, desirable)]: one for an unpaired record, two for a preference record."""
    if isinstance(obj, dict) and detect(obj) == "preference":
        chosen, rejected, chat = pair_pieces(obj, where)
        return [(chosen, chat, True), (rejected, chat, False)]
    if not isinstance(obj, dict) or detect(obj) != "unpaired":
        keys = ", ".join(sorted(map(str, obj))) if isinstance(obj, dict) else f"a JSON {json_type(obj)}"
        raise ShardfitError(f"not a KTO record (found: {keys or 'none'})", where=where,
                            fix="write every record as {\"prompt\", \"completion\", \"label\": true|false} or "
                                "{\"prompt\", \"chosen\", \"rejected\"}")
    label = obj["label"]
    if not isinstance(label, bool):
        raise ShardfitError(f"label: a JSON {json_type(label)}, not true or false", where=where,
                            fix="label: true for a desirable completion, false for an undesirable one")
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise ShardfitError("completion: empty", where=where, fix="give every example a completion")
        return [([(prompt, False), (completion, True), (None, True)], False, label)]
    if isinstance(prompt, list) and isinstance(completion, list):
        head = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in check_messages(prompt, "prompt", where)]
        tail = check_messages(completion, "completion", where)
        if not any(m["role"] == "assistant" for m in tail):
            raise ShardfitError("completion: no assistant message", where=where,
                                fix="end the completion with the assistant's answer")
        return [(head + tail, True, label)]
    raise ShardfitError(f"mixed field types (prompt a JSON {json_type(prompt)}, completion a JSON "
                        f"{json_type(completion)})", where=where,
                        fix="give prompt and completion both as strings, or both as lists of messages")


def mismatched(examples: list[Sequence]) -> list[Sequence]:
    """Example i's KL sequence: its prompt, then example i-1's completion (module docstring)."""
    def split(seq: Sequence) -> int:
        return int(np.argmax(seq[1]))  # the first trained token: every kept example has one

    out = []
    for i, (ids, trained) in enumerate(examples):
        other_ids, other_trained = examples[i - 1]
        a, b = split((ids, trained)), split(examples[i - 1])
        out.append((np.concatenate([ids[:a], other_ids[b:]]),
                    np.concatenate([np.zeros(a, dtype=bool), other_trained[b:]])))
    return out


class UnpairedExamples(PreferencePairs):
    """One labelled example per item; sides_of gives (the example, its KL sequence), as a pair's (chosen, rejected),
    so the reference pass and its file serve both."""

    unit = "examples"

    def __init__(self, examples: list[Sequence], labels: list[bool], seq_len: int, seed: int, where: str):
        if len(examples) < 2:
            raise ShardfitError(f"{len(examples)} KTO example: its KL reference point needs another example's "
                                "completion", where=where, fix="give at least 2 examples (TRL needs 2 a batch)")
        super().__init__(list(zip(examples, mismatched(examples))), seq_len, seed, where)
        self.labels = np.asarray(labels, dtype=bool)
        self.truncation = Truncation.of(examples, seq_len)  # the KL sequences are not trained
        self.n_tokens = self.truncation.kept

    def item_length(self, k: int) -> int:
        return min(len(self.pairs[self._item(k)][0][0]) - 1, self.seq_len)
