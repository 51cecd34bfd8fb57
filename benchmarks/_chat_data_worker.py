"""One rank of ``chat_data_pipeline.py``: a gloo process group, then the text source of a GLM chat recipe for this
data-parallel rank, then the first step's micro batches. Prints one JSON line (rank 0 gathers every rank's).

Measured per rank: seconds from the process group's start to the first step's batches (the data time), peak RSS
(``ru_maxrss``: anonymous and file-backed pages) and the peaks of its two parts, sampled every 20 ms: ``RssAnon``
(memory only this rank holds) and ``RssFile`` (mapped files' resident pages: the corpus entry's touched pages, and
for the builder the ``datasets`` Arrow file it reads through; page cache, shared and reclaimable).
``--baseline`` runs the loader of an older checkout (``PYTHONPATH``) whose chat path reads ``apply_chat_template``'s
result as a list: patched here to read ``input_ids`` so that it tokenizes at all (its cost is otherwise unchanged).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time


def rss_bytes(field: str) -> int:
    """``RssAnon`` (memory only this process holds) or ``RssFile`` (file-backed pages it maps: page cache, which
    the kernel reclaims under pressure and every process mapping the file shares) from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Peaks of ``RssAnon`` and ``RssFile``, sampled every 20 ms."""

    def __init__(self) -> None:
        self.anon, self.file = rss_bytes("RssAnon"), rss_bytes("RssFile")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.anon = max(self.anon, rss_bytes("RssAnon"))
        self.file = max(self.file, rss_bytes("RssFile"))

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.anon, self.file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--baseline", action="store_true")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from nemo_ac.config.schema import DataConfig
    from nemo_ac.data.text import TextBatches

    if args.baseline:
        from nemo_ac.data import text as old_text

        def render(self, messages, *, prompt):  # the one-line container fix; the O(turns^2) calls stay
            out = self.tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=prompt)
            return list(out["input_ids"] if hasattr(out, "keys") else out)

        old_text._HFText._render = render
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base_anon, base_file = rss_bytes("RssAnon"), rss_bytes("RssFile")
    peak = PeakRss()
    data = DataConfig(
        kind="text", path=args.path, messages_column="messages", tokenizer=args.tokenizer, seq_len=args.seq_len
    )
    start = time.perf_counter()
    error = None
    try:
        source = TextBatches(
            data, vocab_size=2**20, global_batch_size=world, micro_batch_size=1, dp_rank=rank, dp_size=world, seed=0
        )
        built = time.perf_counter()
        batches = source.batches_for_step(0)
        tokens = int(sum(b.input_ids.numel() for b in batches))
    except Exception as exc:  # the older loader's failure is a result, not a crash of the benchmark
        built, tokens, error = time.perf_counter(), 0, f"{type(exc).__name__}: {exc}"[:200]
    done = time.perf_counter()
    peak_anon, peak_file = peak.stop()
    record = {
        "rank": rank,
        "source_s": built - start,
        "data_s": done - start,
        "batch_tokens": tokens,
        "error": error,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "base_rss": base_rss,
        "peak_anon": peak_anon,
        "base_anon": base_anon,
        "peak_file": peak_file,
        "base_file": base_file,
        "documents": (getattr(source, "num_documents", None) or len(source.documents)) if error is None else None,
        "pid": os.getpid(),
    }
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        print("RESULT " + json.dumps(records), flush=True)
    dist.destroy_process_group()
    del torch


if __name__ == "__main__":
    main()
