"""`andrea chat`: turns encoded with the chat template, scripted from standard input, streamed text, old turns
dropped when the conversation outgrows the context, Ctrl-C; and the training log's sample lines."""

import io
import json
import os
import signal
from types import SimpleNamespace

import pytest

from andrea.tools.chat import ChatSession, ReplyInterrupts
from andrea.cli import main as cli
from andrea.tools.sample import Sampler, load_sampler, one_line, sample

from conftest import EXPERIMENTS, train_numpy, write_experiment

SETTINGS = ["--temperature", "1", "--top-k", "0", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, chat_data):
    """ANDREA-tiny trained 6 steps with samples at steps 3 and 6: NAME.ckpt, NAME.best.ckpt and NAME.log."""
    folder = tmp_path_factory.mktemp("chat")
    raw = json.loads((EXPERIMENTS / "ANDREA-tiny-TRAIN.json").read_text())
    raw.update(train={"steps": 6}, intervals={"checkpoint": 0, "sample": 3, "eval": 3, "eval_batches": 1})
    out = folder / "tiny.ckpt"
    assert train_numpy(write_experiment(folder, raw), chat_data, out) == 0
    return out


def chat(monkeypatch, capsys, ckpt, lines: str, *args) -> tuple[int, str, str]:
    """`andrea chat` with `lines` on a standard input that is not a terminal: exit status, stdout, stderr."""
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = cli(["chat", "--ckpt", str(ckpt), *args])
    out, err = capsys.readouterr()
    return code, out, err


def turns_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def encoded(tokenizer, system, pairs, user) -> list[int]:
    turns = [{"role": "system", "content": system}] if system else []
    for question, answer in pairs:
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return tokenizer.encode_prompt(turns + [{"role": "user", "content": user}])


def test_scripted_chat_answers_each_line_from_the_conversation_so_far(monkeypatch, capsys, trained):
    code, out, err = chat(monkeypatch, capsys, trained, "hi\n\nwhat is zip?\n", "--json", "--seed", "3", *SETTINGS)
    first, second = turns_of(out)  # the empty line is no message
    assert code == 0 and err == ""
    # the first reply is `andrea sample`'s for the same seed and settings; the second prompt holds it
    alone = sample(trained, "hi", seed=3, temperature=1.0, top_k=0, max_new_tokens=8)
    assert first["reply"] == alone["completion"] and first["new_tokens"] == alone["new_tokens"]
    tokenizer = load_sampler(trained)[0].tokenizer
    assert first["prompt_tokens"] == len(encoded(tokenizer, None, [], "hi"))
    assert second["prompt_tokens"] == len(encoded(tokenizer, None, [("hi", first["reply"])], "what is zip?"))
    assert (first["turn"], second["turn"], second["prompt"], second["dropped_turns"]) == (1, 2, "what is zip?", 0)
    # same seed, same conversation; the plain output prints the same replies after a prefix
    assert chat(monkeypatch, capsys, trained, "hi\nwhat is zip?\n", "--json", "--seed", "3", *SETTINGS)[1] == out
    code, plain, _ = chat(monkeypatch, capsys, trained, "hi\nwhat is zip?\n", "--seed", "3", *SETTINGS)
    assert code == 0 and plain == "".join(f"assistant> {t['reply']}\n" for t in (first, second))


def test_chat_takes_the_best_checkpoint_and_refuses_out_of_range_options(monkeypatch, capsys, trained):
    best = trained.with_name("tiny.best.ckpt")
    code, out, _ = chat(monkeypatch, capsys, best, "hi\n", "--json", *SETTINGS)
    assert code == 0 and len(turns_of(out)) == 1
    code, out, err = chat(monkeypatch, capsys, trained.with_name("missing.ckpt"), "hi\n")
    assert code == 2 and out == "" and "checkpoint not found" in err and len(err.strip().splitlines()) == 1
    for option, value in (("--temperature", "-1"), ("--top-k", "-1"), ("--max-new-tokens", "0")):
        with pytest.raises(SystemExit) as exit_:
            cli(["chat", "--ckpt", str(trained), option, value])
        assert exit_.value.code == 2 and "is not a" in capsys.readouterr().err


def test_a_long_conversation_drops_its_oldest_turns_and_keeps_the_system_message(monkeypatch, capsys, trained):
    messages = [f"tell me about item number {i} of the list" for i in range(6)] + ["word " * 80]
    code, out, err = chat(monkeypatch, capsys, trained, "".join(m + "\n" for m in messages), "--json",
                          "--system", "Be brief.", *SETTINGS)
    turns = turns_of(out)
    assert code == 0 and len(turns) == 7
    assert "shorten it" in turns[-1]["error"]  # too long even alone: refused, and the chat goes on
    tokenizer = load_sampler(trained)[0].tokenizer
    pairs = [(t["prompt"], t["reply"]) for t in turns[:-1]]
    dropped = [t["dropped_turns"] for t in turns[:-1]]
    assert dropped == sorted(dropped) and dropped[-1] > 0
    for i, t in enumerate(turns[:-1]):
        assert t["prompt_tokens"] == len(encoded(tokenizer, "Be brief.", pairs[t["dropped_turns"]:i], t["prompt"]))
        assert t["prompt_tokens"] + 8 <= 64 or t["dropped_turns"] == i  # room for a reply, unless nothing is left
    assert err.count("oldest turns are dropped") == 1 and err.count("shorten it") == 1


class Spelled:
    """A sampler stand-in that 'generates' the token ids of a text, one at a time."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer = tokenizer
        self.shape = SimpleNamespace(seq_len=64)
        self.ids = tokenizer.encode_text(text)

    def stream(self, prompt_ids, *, max_new_tokens, temperature, top_k, rng):
        yield from self.ids[:max_new_tokens]


def test_streamed_text_is_the_reply_in_whole_characters(trained):
    tokenizer = load_sampler(trained)[0].tokenizer
    text = "naïve → 日本語 ok"
    spelled = Spelled(tokenizer, text)
    ids = spelled.ids  # some characters spread over several byte tokens
    inside = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    pieces: list[str] = []
    turn = ChatSession(spelled, max_new_tokens=64).reply("hi", pieces.append)
    assert "".join(pieces) == turn["reply"] == text and not any("\ufffd" in p for p in pieces)
    # a reply cut inside a character: what was held back comes out at its end
    pieces.clear()
    cut = tokenizer.decode(ids[:inside])
    turn = ChatSession(spelled, max_new_tokens=inside).reply("hi", pieces.append)
    assert "".join(pieces) == turn["reply"] == cut


def test_streamed_text_of_a_sampled_reply_equals_its_decoded_text(trained):
    sampler = load_sampler(trained)[0]
    for seed in range(3):
        session = ChatSession(sampler, temperature=1.0, top_k=0, seed=seed, max_new_tokens=12)
        for message in ("hi", "and then?"):
            pieces: list[str] = []
            turn = session.reply(message, pieces.append)
            assert "".join(pieces) == turn["reply"]


def test_ctrl_c_stops_a_reply_and_a_second_one_leaves(monkeypatch, capsys, trained):
    interrupts_per_turn = iter([1, 2, 0])
    original = Sampler.stream

    def interrupted(self, *args, **kwargs):
        signals = next(interrupts_per_turn)
        for i, token in enumerate(original(self, *args, **kwargs)):
            if i == 1:  # Ctrl-C while the second token is picked
                for _ in range(signals):
                    os.kill(os.getpid(), signal.SIGINT)
            yield token

    monkeypatch.setattr(Sampler, "stream", interrupted)
    before = signal.getsignal(signal.SIGINT)
    code, out, _ = chat(monkeypatch, capsys, trained, "one\ntwo\nthree\n", "--json", "--temperature", "1", "--top-k",
                        "0", "--max-new-tokens", "30")
    turns = turns_of(out)
    assert code == 0 and [t["stopped_by"] for t in turns] == ["interrupted", "interrupted"]  # "three" never asked
    assert all(t["new_tokens"] == 2 for t in turns)
    assert signal.getsignal(signal.SIGINT) is before
    with ReplyInterrupts() as interrupts:
        os.kill(os.getpid(), signal.SIGINT)
    assert interrupts.stopped() and interrupts.count == 1


def test_samples_appear_in_the_training_log(trained):
    log = trained.with_name("tiny.log").read_text().splitlines()
    history = json.loads(trained.with_name("tiny.samples.json").read_text())
    for entry in history:
        lines = [line for line in log if f" sample step {entry['step']}: " in line]
        assert len(lines) == len(entry["samples"]) == 3
        for line, s in zip(lines, entry["samples"]):
            assert line.endswith(f" -> {one_line(s['completion'], 200)}")
    assert [e["step"] for e in history] == [3, 6]


def test_one_line():
    assert one_line("a\nb", 10) == "a⏎b"
    assert one_line("x" * 30, 10) == "x" * 9 + "…"
