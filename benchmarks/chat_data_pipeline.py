"""Chat data at ultrachat size: time and memory to the first step's batches, 8 local ranks, first launch and
relaunch, against the loader before the tokenized-corpus cache.

    python benchmarks/chat_data_pipeline.py [--conversations 200000] [--ranks 8] [--baseline-sample 1000]
        [--baseline-commit ec51da3] [--work /tmp/nemo_ac_chat_bench] [--out benchmarks/results/chat_data_pipeline]

1. A synthetic ultrachat-sized corpus, generated here (seeded): ``--conversations`` chats of 4-5 turns (a system
   turn in one of three, then two user / assistant exchanges), about 1.4k tokens each, as JSONL.
2. A real tokenizer: a byte-level BPE (32k ids, the ``tokenizers`` library) trained on a sample of it, with
   GLM-4.5-Air's special tokens and chat template (``recipes/hf_configs/zai-org/GLM-4.5-Air``), saved as a
   transformers ``PreTrainedTokenizerFast``.
3. ``torchrun --nproc-per-node R`` of ``_chat_data_worker.py``: each rank builds the text source of
   ``tiny/glm_4_5_air_tiny``'s data section at 4096-token rows for its data-parallel rank and its first step's
   micro batches. First launch (empty cache), then a relaunch (the entry there).
4. The loader before the cache (``--baseline-commit``, extracted with ``git archive``): every rank tokenizes every
   conversation, rendering and encoding the prefix twice per assistant turn, into Python lists. Run on a sample of
   ``--baseline-sample`` conversations and extrapolated linearly to the corpus (its cost is per conversation);
   its chat path reads ``apply_chat_template``'s ``BatchEncoding`` as a list (and fails at step 1), so the worker
   patches that one read to let it tokenize at all.

Reported per launch: wall time of the launch, per-rank data time (process group start to the first step's
batches: min / max over ranks), peak RSS and peak anonymous RSS per rank (max over ranks), how many processes
tokenized, and the cache entry's size. All on this machine's CPUs; the rank processes share its cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "_chat_data_worker.py"
TEMPLATE = ROOT / "recipes" / "hf_configs" / "zai-org" / "GLM-4.5-Air" / "chat_template.jinja"
SPECIALS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<think>", "</think>")  # fmt: skip
GiB, MiB = 2**30, 2**20


def _lexicon(rng: random.Random, size: int = 6000) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
    words = {"".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3)))) for _ in range(size * 2)}
    return sorted(words)[:size]


def generate_corpus(path: Path, conversations: int, seed: int = 0) -> None:
    """``conversations`` chats (module docstring) written as JSONL; about 1.4k BPE tokens each. Messages are drawn
    from a pool of 100k generated sentences (Zipf-like word frequencies), so a 200k-chat corpus takes seconds."""
    rng = random.Random(seed)
    words = _lexicon(rng)
    cumulative = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(words))))
    pool = [
        " ".join(rng.choices(words, cum_weights=cumulative, k=rng.randint(6, 18))).capitalize()
        + rng.choice((".", ".", ".", "?", "!", ","))
        for _ in range(100_000)
    ]

    def text(sentences: int) -> str:
        return " ".join(rng.choices(pool, k=sentences))

    tmp = path.with_suffix(".partial")
    with tmp.open("w") as out:
        for index in range(conversations):
            messages = [{"role": "system", "content": text(3)}] if index % 3 == 0 else []
            for _ in range(2):
                messages.append({"role": "user", "content": text(rng.randint(5, 13))})
                messages.append({"role": "assistant", "content": text(rng.randint(30, 56))})
            out.write(json.dumps({"messages": messages}) + "\n")
    tmp.rename(path)


def train_tokenizer(corpus: Path, directory: Path, sample: int = 20000, vocab: int = 32000) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        with corpus.open() as lines:
            for index, line in enumerate(lines):
                if index >= sample:
                    return
                yield from (turn["content"] for turn in json.loads(line)["messages"])

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(directory)


def launch(ranks: int, path: Path, tokenizer: Path, env: dict[str, str], *, baseline: bool = False) -> dict:
    """One torchrun launch of the worker; its wall time, every rank's record and how many ranks tokenized."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(WORKER), "--path", str(path), "--tokenizer", str(tokenizer)] + (["--baseline"] if baseline else [])  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    records = json.loads(line[len("RESULT ") :])
    return {
        "wall_s": wall,
        "ranks": records,
        "tokenized_by": len(re.findall(r"data \| tokenized", proc.stderr)),
        "waited": len(re.findall(r"data \| waiting for", proc.stderr)),
        "stderr_tail": proc.stderr[-1500:],
    }


def summarize(run: dict, scale: float = 1.0) -> dict:
    ranks = run["ranks"]
    anon = [r["peak_anon"] - r["base_anon"] for r in ranks]
    return {
        "wall_s": run["wall_s"],
        "data_s_min": min(r["data_s"] for r in ranks) * scale,
        "data_s_max": max(r["data_s"] for r in ranks) * scale,
        "peak_rss_gib": max(r["peak_rss"] for r in ranks) / GiB,
        "peak_anon_gib": max(r["base_anon"] + a * scale for r, a in zip(ranks, anon)) / GiB,
        "peak_file_gib": max(r["peak_file"] for r in ranks) / GiB,
        "data_anon_mib": max(anon) * scale / MiB,
        "tokenized_by": run.get("tokenized_by"),
        "errors": sorted({r["error"] for r in ranks if r["error"]}),
        "documents": ranks[0]["documents"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--baseline-sample", type=int, default=1000)
    parser.add_argument("--baseline-commit", default="ec51da3")
    parser.add_argument("--work", default="/tmp/nemo_ac_chat_bench")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/chat_data_pipeline"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"chats_{args.conversations}.jsonl"
    if not corpus.exists():
        started = time.perf_counter()
        generate_corpus(corpus, args.conversations)
        print(f"corpus: {corpus} ({corpus.stat().st_size / GiB:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    tokenizer = work / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        train_tokenizer(corpus, tokenizer)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    hf_home = work / "hf_home"
    shutil.rmtree(hf_home, ignore_errors=True)  # datasets' Arrow cache too: the first launch converts the JSONL
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEMO_AC_DATA_CACHE": str(cache), "HF_HOME": str(hf_home),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
    results: dict = {"conversations": args.conversations, "ranks": args.ranks, "cpus": os.cpu_count()}
    first = launch(args.ranks, corpus, tokenizer, env)
    results["first_launch"] = summarize(first)
    relaunch = launch(args.ranks, corpus, tokenizer, env)
    results["relaunch"] = summarize(relaunch)
    entry = next(p for p in cache.iterdir() if (p / "meta.json").is_file())
    meta = json.loads((entry / "meta.json").read_text())
    results["entry"] = {"path": str(entry), "mib": sum(meta["bytes"].values()) / MiB,
                        "tokens": meta["total_tokens"], "documents": meta["num_documents"],
                        "tokens_per_conversation": meta["total_tokens"] / meta["num_documents"]}  # fmt: skip
    # The loader before the cache, on a sample, extrapolated.
    old = work / f"baseline_{args.baseline_commit}"
    if not (old / "nemo_ac").is_dir():
        old.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline_commit, "nemo_ac"],
                                 capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    sample = work / f"chats_sample_{args.baseline_sample}.jsonl"
    with corpus.open() as source, sample.open("w") as out:
        for index, line in enumerate(source):
            if index >= args.baseline_sample:
                break
            out.write(line)
    baseline_env = {**env, "PYTHONPATH": str(old), "HF_HOME": str(work / "hf_home_baseline")}
    baseline = launch(args.ranks, sample, tokenizer, baseline_env, baseline=True)
    scale = args.conversations / args.baseline_sample
    results["baseline_sample"] = summarize(baseline)
    results["baseline_extrapolated"] = summarize(baseline, scale=scale)
    results["baseline_extrapolated"]["wall_s"] = None
    results["baseline_commit"] = args.baseline_commit
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for run in (first, relaunch, baseline):
        run.pop("stderr_tail", None)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# Chat data pipeline: {args.conversations:,} conversations, {args.ranks} local ranks, {os.cpu_count()} CPUs",
        "",
        f"Corpus: {meta['num_documents']:,} documents, {meta['total_tokens']:,} tokens "
        f"({results['entry']['tokens_per_conversation']:,.0f} per conversation), cache entry "
        f"{results['entry']['mib']:,.0f} MiB. Byte-level BPE (32k ids) with GLM-4.5-Air's chat template.",
        "",
        "| launch | wall (s) | data time per rank (s) | peak RSS per rank (GiB) | of it anonymous (GiB) | "
        "of it file-backed (GiB) | processes that tokenized |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [("first launch (empty cache)", results["first_launch"]), ("relaunch (cache there)", results["relaunch"]),
            (f"before the cache: {args.baseline_sample:,}-conversation sample", results["baseline_sample"]),
            (f"before the cache: extrapolated to {args.conversations:,}", results["baseline_extrapolated"])]  # fmt: skip
    for name, row in rows:
        wall = f"{row['wall_s']:.1f}" if row["wall_s"] is not None else "-"
        tokenized = row["tokenized_by"] if row["tokenized_by"] else (args.ranks if "before" in name else 0)
        lines.append(
            f"| {name} | {wall} | {row['data_s_min']:.2f} - {row['data_s_max']:.2f} | "
            f"{'-' if 'extrapolated' in name else format(row['peak_rss_gib'], '.2f')} | {row['peak_anon_gib']:.2f} | "
            f"{'-' if 'extrapolated' in name else format(row['peak_file_gib'], '.2f')} | {tokenized} |"
        )
    lines += [
        "",
        "Data time: from the process group's start to the first step's micro batches on each rank (the first launch: "
        "the builder reads the JSONL into `datasets`' Arrow cache, renders and encodes every chat, writes the entry; "
        "the other ranks wait on its lock). File-backed RSS is page cache the process maps (the Arrow file the builder "
        "reads through, the entry's touched pages), shared between processes and reclaimed under memory pressure; "
        "anonymous RSS is what the rank alone holds. Before the cache: every rank tokenizes every conversation "
        "into Python lists (extrapolated linearly from the sample; the file-backed part is not extrapolated).",
    ]
    errors = results["baseline_sample"]["errors"]
    lines += ["", f"Before the cache, step 1 itself failed even with the container read patched: {errors}" if errors
              else "", "Command: `python benchmarks/chat_data_pipeline.py " + " ".join(sys.argv[1:]) + "`"]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
