"""Writes the small datasets that ship in examples/data (deterministic; re-run to regenerate).

- corpus.txt          plain English-like text the demo's tokenizer is trained on
- chat_train.jsonl    chat conversations (the demo's fine-tuning data), chat_valid.jsonl held out
- prompt_completion.jsonl, alpaca.jsonl, text.jsonl: the same kind of content in the other formats

The tasks are simple and regular (arithmetic in words, capitals, opposites, spelling, colours,
counting), so that a tiny model fine-tuned for a few hundred steps on a CPU visibly learns them.
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "data"

NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
           "fifteen sixteen seventeen eighteen nineteen twenty").split()
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Peru": "Lima",
    "Chile": "Santiago", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Russia": "Moscow",
    "Australia": "Canberra", "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest",
    "Argentina": "Buenos Aires", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Morocco": "Rabat",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark", "up": "down",
    "early": "late", "open": "closed", "full": "empty", "high": "low", "old": "new", "hard": "soft",
    "strong": "weak", "rich": "poor", "near": "far", "wet": "dry", "long": "short", "loud": "quiet",
}
COLOURS = {"grass": "green", "the sky": "blue", "snow": "white", "coal": "black", "a banana": "yellow",
           "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown"}
WORDS = ("cat dog bird fish tree river stone cloud apple bread house table chair water light music "
         "garden window paper yellow planet winter summer").split()


def examples(rng: random.Random):
    """(question, answer) pairs."""
    while True:
        kind = rng.randrange(6)
        if kind == 0:
            a, b = rng.randrange(11), rng.randrange(10)
            yield f"What is {NUMBERS[a]} plus {NUMBERS[b]}?", f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
        elif kind == 1:
            c = rng.choice(sorted(CAPITALS))
            yield f"What is the capital of {c}?", f"The capital of {c} is {CAPITALS[c]}."
        elif kind == 2:
            w = rng.choice(sorted(OPPOSITES))
            yield f"What is the opposite of {w}?", f"The opposite of {w} is {OPPOSITES[w]}."
        elif kind == 3:
            w = rng.choice(WORDS)
            yield f"Spell the word {w}.", f"{w.capitalize()} is spelled " + "-".join(w.upper()) + "."
        elif kind == 4:
            t = rng.choice(sorted(COLOURS))
            yield f"What colour is {t}?", f"{t[0].upper() + t[1:]} is {COLOURS[t]}."
        else:
            n = rng.randrange(1, 8)
            w = rng.choice(WORDS)
            yield f"Count to {NUMBERS[n]}.", "Counting to " + NUMBERS[n] + ": " + ", ".join(NUMBERS[1:n + 1]) + "."


SYSTEM = "You are a concise assistant. Answer in one sentence."


def chat(rng, gen):
    q, a = next(gen)
    msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if rng.random() < 0.4:  # a second turn
        q2, a2 = next(gen)
        msgs += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
    return {"messages": msgs}


def write_jsonl(name, rows):
    with open(OUT / name, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    gen = examples(rng)
    write_jsonl("chat_train.jsonl", [chat(rng, gen) for _ in range(2000)])
    write_jsonl("chat_valid.jsonl", [chat(rng, gen) for _ in range(64)])
    pairs = [next(gen) for _ in range(200)]
    write_jsonl("prompt_completion.jsonl", [{"prompt": f"Question: {q}\nAnswer: ", "completion": a} for q, a in pairs])
    write_jsonl("alpaca.jsonl", [{"instruction": q, "input": "", "output": a} for q, a in pairs[:100]] +
                [{"instruction": "Answer the question.", "input": q, "output": a} for q, a in pairs[100:]])
    write_jsonl("text.jsonl", [{"text": f"{q} {a}"} for q, a in pairs])
    lines = []
    for _ in range(3000):
        q, a = next(gen)
        lines.append(f"{q} {a}")
    lines += [f"{SYSTEM}"] * 20
    (OUT / "corpus.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
