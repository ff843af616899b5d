import json

from shardfit.data import ByteTokenizer, HFTokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "plain ascii, ümlauts, 中文, emoji 🚀 and\ttabs\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id]) == text  # specials are not text
    assert tok.vocab_size == 259


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator(["hello world, hello shardfit"] * 50,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|eot|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from tokenizers import decoders

    tk.decoder = decoders.ByteLevel()
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_id == tk.token_to_id("<|eot|>")
    ids = tok.encode("hello shardfit")
    assert len(ids) < len("hello shardfit") and tok.decode(ids) == "hello shardfit"
