"""`andrea chat`: a conversation with a checkpoint in the terminal, on the Sampler `andrea sample` uses.

Each turn the conversation so far (the system message, the user's and the assistant's turns, the new user
message) is encoded with the chat template (`ChatTokenizer.encode_prompt`), and the reply is generated until
<|im_end|> or --max-new-tokens, printed as it comes. One random generator, seeded once, serves the whole
conversation: the same seed and messages give the same conversation, and the first reply is the one
`andrea sample` gives for that message.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Callable

import numpy as np

from andrea.common.errors import AndreaError
from andrea.tools.sample import TEMPERATURE, TOP_K, add_generation_options

REPLY_ROOM_FRACTION = 4  # old turns go once the prompt leaves less than seq_len / 4 (or --max-new-tokens) to reply
USER_PREFIX = "user> "
ASSISTANT_PREFIX = "assistant> "


def stable_text(tokenizer, ids: list[int]) -> str:
    """The decoded ids less any trailing U+FFFD: those may be the first bytes of a character that the next
    tokens complete. What comes before them no later token changes."""
    return tokenizer.decode(ids).rstrip("\ufffd")


class ChatSession:
    """A conversation with one Sampler: the turns so far, the newest of them that fit the context, and the one
    random generator of the conversation."""

    def __init__(self, sampler, *, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = TEMPERATURE, top_k: int = TOP_K, seed: int = 0):
        self.sampler = sampler
        self.tokenizer = sampler.tokenizer
        self.seq_len = sampler.shape.seq_len
        self.system = [{"role": "system", "content": system}] if system else []
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.turns: list[tuple[str, str]] = []  # (user, assistant), oldest first
        self.first_kept = 0  # turns before it are dropped for good: the conversation only moves forward
        self.reply_room = min(max_new_tokens, self.seq_len // REPLY_ROOM_FRACTION)
        alone = len(self.tokenizer.encode_prompt(self.system))
        if alone >= self.seq_len:
            raise AndreaError(f"--system is {alone} tokens with its chat markup; the model sees at most "
                              f"{self.seq_len - 1} before it must generate; shorten it")

    def _prompt_ids(self, user: str, first: int) -> list[int]:
        turns = list(self.system)
        for question, answer in self.turns[first:]:
            turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return self.tokenizer.encode_prompt(turns + [{"role": "user", "content": user}])

    def prompt(self, user: str) -> tuple[list[int], int]:
        """The prompt for the next reply and the index of its oldest turn: the oldest turns dropped until the
        prompt leaves `reply_room` tokens of the context. Changes nothing (AndreaError) when the message does
        not fit even alone."""
        first = self.first_kept
        ids = self._prompt_ids(user, first)
        while len(ids) + self.reply_room > self.seq_len and first < len(self.turns):
            first += 1
            ids = self._prompt_ids(user, first)
        if len(ids) >= self.seq_len:
            raise AndreaError(f"that message is {len(ids)} tokens with its chat markup; the model sees at most "
                              f"{self.seq_len - 1} before it must generate; shorten it")
        return ids, first

    def reply(self, user: str, write: Callable[[str], None] | None = None,
              stop: Callable[[], bool] = lambda: False) -> dict:
        """The assistant's reply to `user`, added to the conversation. `write` gets the text as it comes, in
        pieces that join to the reply; `stop()`, asked after each token, ends the reply early (what was
        written stays the reply)."""
        prompt_ids, first = self.prompt(user)
        ids: list[int] = []
        shown = ""
        stopped_by = None
        for token in self.sampler.stream(prompt_ids, max_new_tokens=self.max_new_tokens,
                                         temperature=self.temperature, top_k=self.top_k, rng=self.rng):
            ids.append(token)
            if write:
                text = stable_text(self.tokenizer, ids)
                if len(text) > len(shown) and text.startswith(shown):
                    write(text[len(shown):])
                    shown = text
            if stop():
                stopped_by = "interrupted"
                break
        text = self.tokenizer.decode(ids)
        if write and text.startswith(shown) and len(text) > len(shown):
            write(text[len(shown):])  # trailing bytes that never became a character
        self.first_kept = first
        self.turns.append((user, text))
        return {
            "turn": len(self.turns), "prompt": user, "reply": text, "prompt_tokens": len(prompt_ids),
            "new_tokens": len(ids),
            "stopped_by": stopped_by or ("max_new_tokens" if len(ids) == self.max_new_tokens else "end of turn"),
            "dropped_turns": first,
        }


class ReplyInterrupts:
    """Ctrl-C (SIGINT) while a reply is generated: counted, not raised, so the reply stops between two tokens
    and the model is never left halfway through one. The first stops the reply, a second leaves the chat."""

    def __init__(self):
        self.count = 0
        self.previous = None

    def __enter__(self) -> "ReplyInterrupts":
        self.count = 0
        try:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Ctrl-C keeps its usual meaning
            self.previous = None
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def stopped(self) -> bool:
        return self.count > 0


def read_message(interactive: bool) -> str | None:
    """The next message: a line typed after the prompt, or the next line of standard input; None at EOF."""
    if interactive:
        try:
            return input(USER_PREFIX)
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat with a checkpoint in the terminal",
        description="A multi-turn chat with a checkpoint: each message is answered from the whole conversation "
        "so far, encoded with the chat template (ChatML, as in training), the reply printed as it is generated. "
        "Ctrl-D leaves; Ctrl-C stops a reply, a second Ctrl-C leaves. When the conversation no longer fits the "
        "model's context, the oldest turns are dropped (the system message stays). When standard input is not "
        "a terminal, each line is one message and each reply is printed after 'assistant> ' (or, with --json, "
        "as one JSON object per line). The experiment and tokenizer come from the checkpoint's .state.json, as "
        "for `andrea sample`; the same seed and messages give the same conversation.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint, e.g. results/ANDREA-12M.ckpt or its .best.ckpt")
    p.add_argument("--system", help="an optional system message at the start of the conversation")
    add_generation_options(p, seed_help="sampling seed of the whole conversation (default 0)",
                           max_new_help="most tokens of one reply (default 256)")
    p.add_argument("--json", action="store_true",
                   help="print each turn as one JSON object (turn, prompt, reply, prompt_tokens, new_tokens, "
                   "stopped_by, dropped_turns) instead of streaming the reply")
    p.set_defaults(func=main)


def main(args) -> int:
    from andrea.tools.sample import load_sampler

    sampler, exp, step = load_sampler(args.ckpt, experiment=args.experiment, tokenizer=args.tokenizer,
                                      engine=args.engine)
    session = ChatSession(sampler, system=args.system, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"{exp.name} at step {step} on {sampler.engine.name}, a {session.seq_len}-token context. "
              "Ctrl-D leaves; Ctrl-C stops a reply.", file=sys.stderr)
    interrupts = ReplyInterrupts()
    said_dropped = False
    while True:
        try:
            message = read_message(interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the second of a stopped reply, or a first; either leaves
            print()
            return 0
        if message is None:
            return 0
        if not message.strip():
            continue
        try:
            _, dropped = session.prompt(message)
        except AndreaError as err:
            print(f"andrea chat: {err}", file=sys.stderr)
            if args.json:
                print(json.dumps({"prompt": message, "error": str(err)}, ensure_ascii=False), flush=True)
            continue
        if dropped and not said_dropped:
            said_dropped = True
            print(f"andrea chat: the conversation no longer fits the model's {session.seq_len}-token context; "
                  "the oldest turns are dropped from here on (the system message stays)", file=sys.stderr)
        if not args.json:
            print(ASSISTANT_PREFIX, end="", flush=True)
        with interrupts:
            turn = session.reply(message, None if args.json else lambda s: print(s, end="", flush=True),
                                 interrupts.stopped)
        print(json.dumps(turn, ensure_ascii=False) if args.json else "", flush=True)
        if interrupts.count > 1:
            return 0
