"""`automoe train`'s data: every source kind users keep data in, column mapping and ShareGPT,
real chat templates (the ones TRL ships for Qwen3, Llama 3, GPT-OSS and DeepSeek-V3) with tools
and reasoning against Transformers' own apply_chat_template, weighted mixing, a held-out
validation split, parallel tokenisation in bounded memory, and errors that name the record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from automoe.demo import EXAMPLES, build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(EXAMPLES / "data" / "corpus.txt", vocab_size=300).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    from automoe import data

    return data.load_tokenizer(tok_dir)


def chats(n: int) -> list[dict]:
    from conftest import chat_rows

    return chat_rows(n)


def pairs(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} plus {i}?", "completion": f"It is {2 * i}."} for i in range(n)]


def docs(path) -> list[tuple[list, list]]:
    from automoe import data

    ids, masks = data.read(path)
    return [(a.tolist(), m.tolist()) for a, m in zip(ids, masks)]


def build(src, tok, tok_dir, tmp_path, **kw):
    from automoe import data

    kw.setdefault("cache_dir", tmp_path / "cache")
    return data.build(src if isinstance(src, list) else [src], tok, str(tok_dir), **kw)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_kinds(d: Path, rows: list[dict], flat: bool) -> dict[str, object]:
    """The same rows as every kind of source; `flat` rows (strings only) go to CSV too."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    out = {"jsonl": write_jsonl(d / "rows.jsonl", rows)}
    (d / "array.json").write_text(json.dumps(rows, indent=1))
    out["json array"] = d / "array.json"
    (d / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["json lines"] = d / "lines.json"
    pq.write_table(table, d / "rows.parquet", row_group_size=7)
    out["parquet"] = d / "rows.parquet"
    with pa.OSFile(str(d / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=5)
    out["arrow stream"] = d / "stream.arrow"
    with pa.OSFile(str(d / "file.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    out["arrow file"] = d / "file.arrow"
    if flat:
        import csv

        with open(d / "rows.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        out["csv"] = d / "rows.csv"
    shards = d / "shards"
    shards.mkdir()
    half = len(rows) // 2
    write_jsonl(shards / "part-0.jsonl", rows[:half])
    pq.write_table(pa.Table.from_pylist(rows[half:]), shards / "part-1.parquet")
    out["directory"] = shards
    out["glob"] = str(shards / "part-*")
    datasets.Dataset.from_list(rows).save_to_disk(str(d / "disk"))
    out["save_to_disk"] = d / "disk"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(d / "diskdict"))
    out["save_to_disk DatasetDict"] = {"path": str(d / "diskdict"), "split": "train"}
    return out


@pytest.mark.parametrize("flat", [True, False], ids=["prompt_completion", "chat"])
def test_every_source_kind_gives_the_documents_of_the_same_rows_as_jsonl(tok, tok_dir, tmp_path, flat):
    rows = pairs(23) if flat else chats(23)
    kinds = write_kinds(tmp_path / "src", rows, flat)
    want = docs(build(str(kinds["jsonl"]), tok, tok_dir, tmp_path).path)
    assert len(want) == 23 and all(sum(m) for _, m in want)
    for kind, src in kinds.items():
        got = build(src if isinstance(src, dict) else str(src), tok, tok_dir, tmp_path)
        assert docs(got.path) == want, kind
        assert got.stats["documents"] == 23, kind


def test_columns_map_onto_the_format_and_sharegpt_becomes_messages(tok, tok_dir, tmp_path):
    rows = pairs(5)
    renamed = write_jsonl(tmp_path / "qa.jsonl", [{"question": r["prompt"], "answer": r["completion"], "id": i}
                                                  for i, r in enumerate(rows)])
    want = docs(build(str(write_jsonl(tmp_path / "pc.jsonl", rows)), tok, tok_dir, tmp_path).path)
    got = build({"path": str(renamed), "columns": {"prompt": "question", "completion": "answer"}},
                tok, tok_dir, tmp_path)
    assert docs(got.path) == want
    conv = chats(6)
    sharegpt = []
    for c in conv:
        m = c["messages"]
        sys_msg = m[0]["content"] if m[0]["role"] == "system" else None
        turns = [{"from": {"user": "human", "assistant": "gpt"}[x["role"]], "value": x["content"]}
                 for x in m if x["role"] != "system"]
        sharegpt.append({"conversations": turns, **({"system": sys_msg} if sys_msg else {})})
    want = docs(build(str(write_jsonl(tmp_path / "chat.jsonl", conv)), tok, tok_dir, tmp_path).path)
    assert docs(build(str(write_jsonl(tmp_path / "sg.jsonl", sharegpt)), tok, tok_dir, tmp_path).path) == want
    dialog = write_jsonl(tmp_path / "dialog.jsonl", [{"dialog": c["messages"]} for c in conv])
    assert docs(build({"path": str(dialog), "columns": {"messages": "dialog"}}, tok, tok_dir, tmp_path).path) == want
    turns = write_jsonl(tmp_path / "turns.jsonl", [{"turns": r["conversations"], **({"system": r["system"]} if
                                                    "system" in r else {})} for r in sharegpt])
    assert docs(build({"path": str(turns), "columns": {"messages": "turns"}}, tok, tok_dir, tmp_path).path) == want
    from automoe import data

    with pytest.raises(data.DataError, match=r"qa\.jsonl:1: no column \"query\" \(columns: maps prompt to it"):
        build({"path": str(renamed), "columns": {"prompt": "query", "completion": "answer"}}, tok, tok_dir, tmp_path)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def conversations(template: str) -> dict[str, dict]:
    """Conversations in the shape each template takes: tool calls (arguments as a mapping, or as
    JSON text where the template concatenates them), tool results, reasoning content."""
    deepseek = template.startswith("deepseek")
    args = '{"city": "Paris"}' if deepseek else {"city": "Paris"}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": args}}
    reasoning_key = "thinking" if template.startswith("gptoss") else "reasoning_content"
    out = {
        "plain": {"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a red fruit."}, {"role": "assistant", "content": "An apple."},
            {"role": "user", "content": "And a yellow one?"}, {"role": "assistant", "content": "A banana."}]},
        "tools": {"tools": TOOLS, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None if deepseek else "", "tool_calls": [call]},
            {"role": "tool", "name": "get_weather", "content": "Sunny, 21 C."},
            {"role": "assistant", "content": "It is sunny in Paris."}]},
        "reasoning": {"messages": [
            {"role": "user", "content": "Is 7 prime?"},
            {"role": "assistant", reasoning_key: "Seven has no divisor but 1 and 7.", "content": "Yes."}]},
    }
    if template.startswith("llama3") and template != "llama3_2":
        del out["tools"]  # Llama 3's template has no tools
    return out


TEMPLATES = ["qwen3", "qwen3_training", "llama3", "llama3_training", "llama3_2", "gptoss", "gptoss_training",
             "deepseekv3", "deepseekv3_training"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_real_chat_templates_give_transformers_tokens_and_assistant_masks(tok, template):
    """Tokens are apply_chat_template's; where the template marks {% generation %} the loss mask
    is Transformers' return_assistant_tokens_mask, elsewhere it covers every assistant turn (its
    content, tool calls and reasoning) and nothing of the user, system or tool turns."""
    import copy

    from automoe.data import Encoder

    t = copy.deepcopy(tok)
    t.chat_template = (TRL_TEMPLATES / f"{template}.jinja").read_text()
    if t.bos_token is None:  # Llama's and DeepSeek's templates start with it
        t.bos_token = t.eos_token
    enc = Encoder(t, "chat", "completion")
    assert enc.generation_marks == template.endswith("_training")
    for name, rec in conversations(template).items():
        ref = t.apply_chat_template(rec["messages"], tools=rec.get("tools"), tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=enc.generation_marks)
        ids, mask = enc(rec)
        assert ids == list(ref["input_ids"]), (template, name)
        [(batch_ids, batch_mask)] = enc.encode_batch([rec])
        assert batch_ids.tolist() == ids and batch_mask.tolist() == mask, (template, name)
        if enc.generation_marks:
            assert mask == list(ref["assistant_masks"]), (template, name)
        trained = t.decode([i for i, m in zip(ids, mask) if m])
        untrained = t.decode([i for i, m in zip(ids, mask) if not m])
        for m in rec["messages"]:
            texts = [m.get("content") or "", m.get("reasoning_content", ""), m.get("thinking", "")]
            for text in filter(None, texts):
                side = trained if m["role"] == "assistant" else untrained
                if m["role"] == "assistant" and "reasoning" in name and text != m.get("content") \
                        and text not in t.decode(ids):
                    continue  # a template that does not render reasoning at all
                assert text in side, (template, name, m["role"], text)
                if m["role"] != "assistant":
                    assert text not in trained, (template, name, m["role"])
        if name == "tools":
            assert "get_weather" in trained or "Paris" in trained, template  # the call is trained on


def test_weighted_sources_mix_in_ratio_deterministically_for_a_seed(tok, tok_dir, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i} apple"} for i in range(300)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"beta {i} banana"} for i in range(100)])
    first_a = tok("alpha 0 apple")["input_ids"][0]
    srcs = [{"path": str(a), "weight": 1}, {"path": str(b), "weight": 3}]

    def share(ds):
        ids = [d for d, _ in docs(ds.path)]
        from_a = sum(d[0] == first_a for d in ids)
        return from_a, len(ids) - from_a, ids

    one = build(srcs, tok, tok_dir, tmp_path, seed=5)
    n_a, n_b, order = share(one)
    assert (n_a, n_b) == (100, 300)  # an epoch of 400 documents, 1:3
    assert len({tuple(d) for d in order if d[0] == first_a}) == 100  # a's 100: distinct documents
    assert one.stats["composed"] == [100, 300]
    again = build(srcs, tok, tok_dir, tmp_path / "other-cache", seed=5)
    assert share(again)[2] == order
    other = build(srcs, tok, tok_dir, tmp_path, seed=6)
    assert share(other)[:2] == (100, 300) and share(other)[2] != order
    plain = build([str(a), str(b)], tok, tok_dir, tmp_path)
    assert [d for d, _ in docs(plain.path)] == [d for d, _ in docs(build(str(a), tok, tok_dir, tmp_path).path)] + \
        [d for d, _ in docs(build(str(b), tok, tok_dir, tmp_path).path)]  # no weights: concatenated in order


def test_validation_split_holds_out_a_seeded_share_and_max_samples_caps_each_source(tok, tok_dir, tmp_path):
    from automoe import data

    f = write_jsonl(tmp_path / "t.jsonl", [{"text": f"row {i} of the corpus"} for i in range(200)])
    train, val = data.build_split([str(f)], tok, str(tok_dir), cache_dir=tmp_path / "c", seed=1,
                                  validation_split=0.1)
    t_docs, v_docs = [tuple(d) for d, _ in docs(train.path)], [tuple(d) for d, _ in docs(val.path)]
    assert len(v_docs) == 20 and len(t_docs) == 180 and not set(t_docs) & set(v_docs)
    whole = {tuple(d) for d, _ in docs(build(str(f), tok, tok_dir, tmp_path).path)}
    assert set(t_docs) | set(v_docs) == whole
    _, val2 = data.build_split([str(f)], tok, str(tok_dir), cache_dir=tmp_path / "c2", seed=1, validation_split=0.1)
    assert [tuple(d) for d, _ in docs(val2.path)] == v_docs
    few = build(str(f), tok, tok_dir, tmp_path, max_samples=7)
    assert few.stats["documents"] == 7 and few.stats["sources"][0]["records"] == 7


def test_parallel_tokenisation_writes_the_file_one_process_writes(tok, tok_dir, tmp_path):
    rows = chats(300) * 4  # several chunks of a worker each
    f = write_jsonl(tmp_path / "c.jsonl", rows + [{"messages": "oops"}])
    one = build(str(f), tok, tok_dir, tmp_path, cache_dir=tmp_path / "one", num_proc=1, on_error="skip")
    two = build(str(f), tok, tok_dir, tmp_path, cache_dir=tmp_path / "two", num_proc=2, on_error="skip")
    assert one.path.read_bytes() == two.path.read_bytes()
    assert two.stats["documents"] == 1200 and two.stats["skipped_lines"] == 1
    from automoe import data

    with pytest.raises(data.DataError, match=rf"c\.jsonl:{len(rows) + 1}: \"messages\" must be a non-empty list"):
        build(str(f), tok, tok_dir, tmp_path, cache_dir=tmp_path / "three", num_proc=2)


def test_a_worker_that_dies_stops_the_tokenisation_with_an_error_not_a_hang(tok, tok_dir, tmp_path, monkeypatch):
    import signal

    from automoe import data

    class Dying(data.Encoder):  # a worker killed (say, by the OOM killer) in the middle of a chunk
        def encode_batch(self, records):
            if any(r.get("text") == "die" for r in records):
                os.kill(os.getpid(), signal.SIGKILL)
            return super().encode_batch(records)

    monkeypatch.setattr(data, "Encoder", Dying)
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": f"row {i}"} for i in range(1000)] + [{"text": "die"}])
    with pytest.raises(data.DataError, match=r"a tokenising worker process died .* while tokenising the records from .*t\.jsonl:\d+ on"):
        build(str(f), tok, tok_dir, tmp_path, num_proc=2)
    assert not list((tmp_path / "cache").glob("*.amds")) and not list((tmp_path / "cache").glob(".*.tmp-*"))


def test_processes_on_one_machine_tokenise_a_source_once(tok_dir, tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", chats(400))
    code = textwrap.dedent(f"""
        import json, sys
        from automoe import data
        ds = data.build([{str(f)!r}], None, {str(tok_dir)!r}, cache_dir={str(tmp_path / 'c')!r}, num_proc=1)
        print(json.dumps(ds.stats["reused"]))
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    reused = sorted(json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs)
    assert reused == [False, True]


def test_a_killed_tokenisation_publishes_nothing_and_the_next_one_starts_clean(tok_dir, tmp_path):
    import signal
    import time

    f = write_jsonl(tmp_path / "c.jsonl", chats(2000) * 3)
    cache = tmp_path / "cache"
    code = (f"from automoe import data; data.build([{str(f)!r}], None, {str(tok_dir)!r}, "
            f"cache_dir={str(cache)!r}, num_proc=2)")
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(cache.glob(".*.tmp-*.tokens")) or not any(p.stat().st_size for p in cache.glob(".*.tokens")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the process and its workers, mid-write
    proc.wait()
    assert list(cache.glob(".*.tmp-*")) and not list(cache.glob("*.amds"))
    from automoe import data

    ds = data.build([str(f)], None, str(tok_dir), cache_dir=cache, num_proc=1)
    assert ds.stats["documents"] == 6000 and not ds.stats["reused"]
    assert not list(cache.glob(".*.tmp-*"))


def test_bad_sources_and_records_are_named_with_their_row(tok, tok_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from automoe import data

    def fails(src, pattern, **kw):
        with pytest.raises(data.DataError, match=pattern):
            build(src, tok, tok_dir, tmp_path, **kw)

    pq.write_table(pa.Table.from_pylist(pairs(3) + [{"prompt": "p", "completion": None}]), tmp_path / "p.parquet")
    fails(str(tmp_path / "p.parquet"), r"p\.parquet: row 4: cannot tell the format from the keys prompt")
    assert build(str(tmp_path / "p.parquet"), tok, tok_dir, tmp_path, on_error="skip").stats["skipped_lines"] == 1
    (tmp_path / "x.csv").write_text("prompt,completion\na,b\nc,d,e\n")
    fails(str(tmp_path / "x.csv"), r"x\.csv: row 2: more fields than the header names")
    (tmp_path / "x.txt").write_text("hello\n")
    fails(str(tmp_path / "x.txt"), r"x\.txt: unsupported file type \"\.txt\"")
    (tmp_path / "empty").mkdir()
    fails(str(tmp_path / "empty"), r"data\.train: .*empty: a directory without data files")
    fails(str(tmp_path / "nothing-*.jsonl"), r"the pattern matches no file")
    fails({"path": str(tmp_path / "x.csv"), "split": "train"}, r"split: names a split of a dataset")
    fails(str(tmp_path / "missing.parquet"), r"missing\.parquet: no such file")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "p.parquet").read_bytes()[:-30])
    fails(str(tmp_path / "cut.parquet"), r"cut\.parquet: cannot be read as Parquet")
    (tmp_path / "latin1.csv").write_bytes(b"prompt,completion\ncaf\xe9,b\n")
    fails(str(tmp_path / "latin1.csv"), r"latin1\.csv: row 1: not UTF-8 text")
    (tmp_path / "bad.json").write_text('[{"text": "one"}, {"text": "two"')
    fails(str(tmp_path / "bad.json"), r"bad\.json: element 2: not valid JSON")
    fails([str(tmp_path / "p.parquet"), "nobody/nothing"], r"data\.train\[1\]: nobody/nothing: not in the local "
          r"Hugging Face datasets cache .*datasets\.load_dataset\('nobody/nothing', split='train'\)")


FILL_HUB_CACHE = textwrap.dedent("""
    import json, sys
    import datasets

    cache, repo_id, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    for config_name, splits in spec.items():
        class Rows(datasets.GeneratorBasedBuilder):
            def _info(self):
                return datasets.DatasetInfo()

            def _split_generators(self, dl_manager, splits=splits):
                return [datasets.SplitGenerator(name=s, gen_kwargs={"rows": r}) for s, r in splits.items()]

            def _generate_examples(self, rows):
                for i, row in enumerate(rows):
                    yield i, row

        Rows(cache_dir=cache, repo_id=repo_id, dataset_name=repo_id.split("/")[-1], config_name=config_name,
             config_id=config_name, hash="0123abcd").download_and_prepare()
""")


def test_a_hub_dataset_id_resolves_offline_from_the_local_cache(tok, tok_dir, tmp_path):
    """The cache is filled by `datasets` itself (a builder's download_and_prepare writes what
    load_dataset writes for a hub id); the build runs in a process whose datasets cache is it."""
    hf = tmp_path / "hf"
    rows, other = pairs(9), pairs(12)[9:]
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), HF_HOME=str(hf), HF_DATASETS_CACHE=str(hf / "datasets"),
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    spec = {"en": {"train": rows, "test": other}, "de": {"train": other}}
    subprocess.run([sys.executable, "-c", FILL_HUB_CACHE, str(hf / "datasets"), "acme/qa-pairs", json.dumps(spec)],
                   check=True, env=env, capture_output=True, timeout=300)
    code = textwrap.dedent(f"""
        import json, sys
        from automoe import data
        out = []
        for src in json.loads(sys.argv[1]):
            try:
                ds = data.build([src], None, {str(tok_dir)!r}, cache_dir={str(tmp_path / 'c')!r})
                out.append([d.tolist() for d in data.read(ds.path)[0]])
            except data.DataError as e:
                out.append("ERROR " + str(e))
        print(json.dumps(out))
    """)
    sources = [{"dataset": "acme/qa-pairs", "subset": "en"},
               {"dataset": "acme/qa-pairs", "subset": "en", "split": "test"},
               {"dataset": "acme/qa-pairs", "subset": "en", "revision": "0123abcd"},
               {"dataset": "acme/qa-pairs", "subset": "en", "revision": "ffff0000"},
               {"dataset": "acme/qa-pairs", "subset": "fr"},
               "acme/not-cached"]
    out = subprocess.run([sys.executable, "-c", code, json.dumps(sources)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])

    def want(r):
        return [d for d, _ in docs(build(str(write_jsonl(tmp_path / f"w{len(r)}.jsonl", r)), tok, tok_dir, tmp_path).path)]

    assert got[0] == want(rows) and got[1] == want(other) and got[2] == want(rows)
    assert "revision \"ffff0000\" is not the cached one (0123abcd)" in got[3], got[3]
    assert got[4].startswith("ERROR") and "fr" in got[4] and "en" in got[4], got[4]
    assert "acme/not-cached: not in the local Hugging Face datasets cache" in got[5] and "load_dataset(" in got[5]


RSS = textwrap.dedent("""
    import json, resource, sys
    from automoe import data
    tok = data.load_tokenizer(sys.argv[2])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ds = data.build([sys.argv[1]], tok, sys.argv[2], cache_dir=sys.argv[3], num_proc=2)
    print(json.dumps({"growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
                      "worker_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                      "documents": ds.stats["documents"]}))
""")


def test_tokenising_memory_does_not_grow_with_the_corpus(tok_dir, tmp_path):
    """Peak memory of the tokenising process (above what it held with the tokenizer loaded) and of
    its largest worker, for a corpus and one ten times larger: the same within 20 % (+ 8 MiB for
    allocator noise)."""
    rows = chats(400)
    small = write_jsonl(tmp_path / "small.jsonl", rows)
    big = write_jsonl(tmp_path / "big.jsonl", rows * 10)
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    out = {}
    for name, f in (("small", small), ("big", big)):
        p = subprocess.run([sys.executable, "-c", RSS, str(f), str(tok_dir), str(tmp_path / name)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["big"]["documents"] == 10 * out["small"]["documents"]
    for key in ("growth_kib", "worker_kib"):
        assert out["big"][key] <= 1.2 * out["small"][key] + 8192, (key, out)


def test_automoe_train_reads_mixed_parquet_and_jsonl_sources_and_evaluates_a_held_out_split(tmp_path, chat_checkpoint):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    rows = chats(60)
    pq.write_table(pa.Table.from_pylist([{"dialog": r["messages"]} for r in rows[:40]]), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "plain text document number %d" % i} for i in range(20)])
    recipe = {"model": {"path": str(chat_checkpoint), "dtype": "float32"},
              "data": {"train": [{"path": str(tmp_path / "a.parquet"), "columns": {"messages": "dialog"}, "weight": 3},
                                 {"path": str(tmp_path / "b.jsonl"), "weight": 1}],
                       "validation_split": 0.1, "seq_len": 128, "cache_dir": str(tmp_path / "cache")},
              "train": {"micro_batch_size": 2, "max_steps": 2, "threads": 2},
              "checkpoint": {"dir": str(tmp_path / "run")}, "log": {"progress": "off", "peak_tflops": 1.0}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "automoe.cli", "train", str(path)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "python")), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "documents from" in proc.stderr and "validation data tokenised: 6 documents" in proc.stderr, proc.stderr
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("type") == "eval"]
    assert evals and np.isfinite(evals[-1]["eval_loss"])


def test_every_shipped_example_recipe_is_a_valid_recipe():
    from automoe.train import load_recipe, resolve

    recipes = sorted((REPO / "examples").glob("*.yaml"))
    assert any(r.name == "mixed.yaml" for r in recipes)
    for r in recipes:
        doc = load_recipe(str(r), [])
        for section, key in (("model", "path"), ("checkpoint", "dir")):  # automoe.demo sets them for some
            doc[section] = dict(doc.get(section) or {})
            doc[section][key] = doc[section].get(key) or "set-by-the-demo"
        resolved = resolve(doc, str(r))
        assert resolved["data"]["train"], r


def test_awkward_files_read_as_the_tools_that_write_them_mean_them(tok, tok_dir, tmp_path):
    """Byte-order marks (Excel's CSV, some editors' JSONL), CSV fields beyond the csv module's
    128 KiB default, Arrow files written as one huge batch (read in chunks of 256 rows), a
    directory with a README, and a list of validation sources defaulting to the validation split."""
    import datasets
    import pyarrow as pa

    from automoe import data
    from automoe.data.sources import resolve

    rows = pairs(3)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfprompt,completion\n" +
                                       "".join(f"{r['prompt']},{r['completion']}\n" for r in rows).encode())
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    want = docs(build(str(write_jsonl(tmp_path / "plain.jsonl", rows)), tok, tok_dir, tmp_path).path)
    assert docs(build(str(tmp_path / "bom.csv"), tok, tok_dir, tmp_path).path) == want
    assert docs(build(str(tmp_path / "bom.jsonl"), tok, tok_dir, tmp_path).path) == want
    long = {"prompt": "p", "completion": "word " * 40000}
    (tmp_path / "long.csv").write_text(f"prompt,completion\n{long['prompt']},{long['completion']}\n")
    assert build(str(tmp_path / "long.csv"), tok, tok_dir, tmp_path).stats["documents"] == 1
    table = pa.Table.from_pylist([{"text": f"row {i}"} for i in range(3000)])
    with pa.OSFile(str(tmp_path / "one-batch.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=3000)
    chunks = list(resolve(str(tmp_path / "one-batch.arrow"), "data.train").chunks())
    assert max(len(c) for c in chunks) == 256 and sum(len(c) for c in chunks) == 3000
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", rows)
    (shards / "README.md").write_text("about the data")
    log = __import__("io").StringIO()
    assert build(str(shards), tok, tok_dir, tmp_path, log=log).stats["documents"] == 3
    assert "1 files that are not data files left out (README.md)" in log.getvalue()
    (shards / "b.jsonl.gz").write_bytes(b"")
    with pytest.raises(data.DataError, match=r"b\.jsonl\.gz: compressed data files are not read"):
        build(str(shards), tok, tok_dir, tmp_path)
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "train row"}]),
                          "validation": datasets.Dataset.from_list([{"text": "validation row"}])}).save_to_disk(str(dd))
    val = data.build([str(dd), str(dd)], tok, str(tok_dir), cache_dir=tmp_path / "c", what="data.validation")
    assert all(tok.decode(d).startswith("validation row") for d, _ in docs(val.path))


def test_json_arrays_are_read_strictly_and_deep_nesting_is_a_malformed_record(tok, tok_dir, tmp_path):
    from automoe import data

    for text, message in [('[{"text": "a"}, {"text": "b"', r"element 2: not valid JSON"),
                          ('[{"text": "a"}, {"text": "b"},', r"ends after element 2 and a comma, without the closing"),
                          ('[{"text": "a"} {"text": "b"}]', r"a comma or \] expected after element 1"),
                          ('[{"text": "a"}] {"text": "c"}', r"more than whitespace after the closing \]"),
                          ('[{"text": "a"}', r"ends after element 1 without the closing \]")]:
        (tmp_path / "a.json").write_text(text)
        with pytest.raises(data.DataError, match=message):
            build(str(tmp_path / "a.json"), tok, tok_dir, tmp_path, on_error="skip")
    deep = '{"text": ' + "[" * 100000 + "]" * 100000 + "}"
    f = tmp_path / "deep.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + deep + "\n")
    ds = build(str(f), tok, tok_dir, tmp_path, on_error="skip")
    assert ds.stats["documents"] == 1 and ds.stats["skipped_lines"] == 1


def test_prefix_rule_never_trains_on_prompts_a_template_renders_around_the_turn(tok):
    """Templates without generation marks: a conversation opening with the assistant (Qwen2.5's
    template adds a default system prompt), and a tool result the template does not render
    (Phi-3) before a user turn: the loss stays on the assistant's text."""
    import copy

    from automoe.data import Encoder

    t = copy.deepcopy(tok)
    t.bos_token = t.bos_token or t.eos_token
    cases = [
        ("qwen2_5", [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Name a fruit."},
                     {"role": "assistant", "content": "An apple."}]),
        ("phi3", [{"role": "user", "content": "Q one?"}, {"role": "assistant", "content": "A one."},
                  {"role": "tool", "content": "RESULT"}, {"role": "user", "content": "Q two?"},
                  {"role": "assistant", "content": "A two."}]),
    ]
    for name, msgs in cases:
        t.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
        ids, mask = Encoder(t, "chat", "completion")({"messages": msgs})
        trained = t.decode([i for i, m in zip(ids, mask) if m])
        for m in msgs:
            if m["role"] == "assistant":
                assert m["content"] in trained, (name, trained)
            else:
                assert m["content"] not in trained, (name, trained)
        assert "You are" not in trained and "system" not in trained, (name, trained)


def test_a_dict_of_chat_templates_uses_the_generation_marks_of_the_one_transformers_picks(tok, tok_dir, tmp_path):
    import copy

    from automoe.data import Encoder

    t = copy.deepcopy(tok)
    marked = (TRL_TEMPLATES / "qwen3_training.jinja").read_text()
    t.chat_template = {"default": marked, "tool_use": marked}
    rec = conversations("qwen3_training")["plain"]
    ids, mask = Encoder(t, "chat", "completion")(rec)
    ref = t.apply_chat_template(rec["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
