"""Data from PyTorch for the engine: a torch.utils.data.Dataset of (input, target) pairs, or a DataLoader.

The engine draws each epoch's order itself (seeded: the same order on resume and on every device) and asks for the
samples [offset, offset + count) of that order; Served fetches them from the dataset and collates them. With a
DataLoader of workers, the batches are fetched ahead by a DataLoader over the user's dataset, collate_fn, workers
and worker_init_fn, whose batch sampler is the engine's order cut at the engine's batch size, so workers run the
user's transforms while the GPU runs the step. The user's sampler and batch size are not used: the order is the
engine's and the batch is batch_size (the loader's own when batch_size is not given).

Two threads of Served take the workers' batches as they come (one reads the loader, the other copies each batch out
of the shared memory it arrives in: the first read of those pages is most of a batch's host cost), so the engine's
thread only pins and copies resident memory. The threads call nothing of CUDA: the engine may be capturing its step
in a CUDA graph meanwhile, and any CUDA call from another thread breaks a capture. Pinning happens on the engine's
thread, between steps.

While workers feed a GPU run, host_threads_for leaves the workers their cores: this process's intra-op threads,
which spin on every core after each parallel copy and so take the workers' CPU, are cut to the cores the workers
leave for the run's length (what it was measured to cost: docs/results/python.md).
"""
import contextlib
import os
import queue
import threading

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

__all__ = ["Served", "served_from", "host_threads_for"]


class Served:
    """The engine's SampleSource for one split (called from C++ under the GIL)."""

    def __init__(self, dataset, collate_fn=None, num_workers=0, pin_memory=False, worker_init_fn=None,
                 split="train"):
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"{split}= is a {type(dataset).__name__}: triaccel takes a map-style torch Dataset "
                            "(with __len__ and __getitem__) or a DataLoader over one; an IterableDataset has no "
                            "order the engine can draw or resume")
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.worker_init_fn = worker_init_fn
        self.split = split
        self.order = list(range(len(dataset)))
        self._ordered = False  # epoch_begin came: the workers fetch ahead in its order
        self._loader = None    # the workers' DataLoader over self._batches, made once: its workers persist
        self._batches = _Batches(self)
        self._ahead = None     # the thread reading the workers' batches from offset self._next on
        self._next = None      # the offset of the next batch it yields
        self._size = None      # its batch size

    def size(self):
        return len(self.dataset)

    def epoch_begin(self, order):
        self._ahead_stop()
        self.order = list(order)
        self._ordered = True

    def close(self):
        """Stops the thread that fetches ahead and the loader's workers (at the run's end)."""
        self._ahead_stop()
        self._loader = None  # its iterator's workers shut down with it

    def _ahead_stop(self):
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None

    def _pair(self, batch):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch)):
            raise TypeError(f"{self.split} data: a batch must collate to (inputs, targets), two tensors; got "
                            f"{type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list))
                                                          else ""))
        return tuple(t.contiguous() for t in batch)

    def _pinned(self, pair):
        x, y = pair
        if self.pin_memory and not x.is_pinned():
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def fetch(self, offset, ids):
        if self.num_workers > 0 and self._ordered and list(self.order[offset:offset + len(ids)]) == list(ids):
            if self._ahead is None or self._next != offset or self._size != len(ids):
                self._ahead_stop()
                if self._loader is None:
                    # Workers that persist across epochs (starting 12 of them took about a second an epoch); no
                    # pin-memory thread of the loader's own: it calls CUDA (see the top of this file).
                    self._loader = DataLoader(self.dataset, batch_sampler=self._batches,
                                              num_workers=self.num_workers, collate_fn=self.collate_fn,
                                              pin_memory=False, worker_init_fn=self.worker_init_fn,
                                              persistent_workers=True)
                self._next, self._size = offset, len(ids)
                self._batches.start, self._batches.size = offset, len(ids)
                self._ahead = _Ahead(self._loader, self._pair, depth=2 * self.num_workers)
            pair = self._ahead.get()
            self._next += len(ids)
            return self._pinned(pair)
        return self._pinned(self._pair(self.collate_fn([self.dataset[i] for i in ids])))


class _Batches:
    """The loader's batch sampler: the served order from `start` on, cut into batches of `size` (read when the
    loader starts an iteration)."""

    def __init__(self, served):
        self.served, self.start, self.size = served, 0, 1

    def __iter__(self):
        order = self.served.order
        return iter([order[s:s + self.size] for s in range(self.start, len(order), self.size)])

    def __len__(self):
        return max(0, (len(self.served.order) - self.start + self.size - 1) // self.size)


class _Ahead:
    """Two threads that keep up to `depth` batches of a DataLoader ready: one iterates the loader (its batches arrive
    in the workers' shared memory), the other takes each batch through `prepare` and copies it into private memory.
    The copy releases the GIL, so the loader's next batch is read while the last one is copied (one thread doing
    both runs below the loader's own rate). An exception in the loader or in `prepare` reaches get() in the order it
    came."""

    def __init__(self, loader, prepare, depth):
        depth = max(depth, 2)
        self._arrived = queue.Queue(maxsize=depth)  # ("batch", as the loader gave it) | ("error", e) | ("end", None)
        self._ready = queue.Queue(maxsize=depth)    # the same, each batch prepared and private
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._read, args=(loader,), daemon=True, name="triaccel-fetch-ahead"),
                         threading.Thread(target=self._copy, args=(prepare,), daemon=True, name="triaccel-copy-ahead")]
        for t in self._threads:
            t.start()

    def _put(self, q, item):
        """Puts item unless the source is stopping; True when it was put."""
        while not self._stopping.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self, loader):
        try:
            for batch in loader:
                if not self._put(self._arrived, ("batch", batch)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, which raises it
            self._put(self._arrived, ("error", e))
            return
        self._put(self._arrived, ("end", None))

    def _copy(self, prepare):
        while not self._stopping.is_set():
            try:
                kind, item = self._arrived.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "batch":
                try:
                    x, y = prepare(item)
                    item = (x.clone(), y.clone()) if x.is_shared() else (x, y)  # resident, private memory
                except BaseException as e:  # noqa: BLE001 - as in _read
                    kind, item = "error", e
            if not self._put(self._ready, (kind, item)) or kind != "batch":
                return

    def get(self):
        kind, item = self._ready.get()
        if kind == "error":
            raise item
        if kind == "end":
            raise RuntimeError("the DataLoader ended before the epoch's last batch")
        return item

    def stop(self):
        self._stopping.set()
        for t in self._threads:
            t.join()


def served_from(data, split, cuda, batch_size_given):
    """(Served, the loader's batch size or None) for a Dataset or DataLoader; None for anything else."""
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            raise TypeError(f"{split}= is a DataLoader with a batch_sampler: give it a batch_size (the engine cuts "
                            "its own order into batches)")
        served = Served(data.dataset, data.collate_fn, data.num_workers, cuda,  # pinned on a GPU run
                        data.worker_init_fn, split)
        return served, data.batch_size
    if isinstance(data, Dataset):
        return Served(data, None, 0, cuda, None, split), None
    return None, None


def host_threads_for(sources, cuda):
    """A context in which a GPU run fed by the DataLoader workers of `sources` (Served or anything else, which is
    ignored) trains: this process's intra-op threads cut to the cores the workers leave (at least 1; two cores are
    left to the engine's and the fetching thread), restored after. A CPU run, or one without workers, is left as it
    is: its intra-op threads do the training's work."""
    workers = sum(s.num_workers for s in sources if isinstance(s, Served))
    if not cuda or workers == 0:
        return contextlib.nullcontext()
    return _host_threads(workers)


@contextlib.contextmanager
def _host_threads(workers):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, cores - workers - 2)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
