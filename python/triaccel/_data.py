"""Data from PyTorch for the engine: a torch.utils.data.Dataset of (input, target) pairs, or a DataLoader.

The engine draws each epoch's order itself (seeded: the same order on resume and on every device) and asks for the
samples [offset, offset + count) of that order; Served fetches them from the dataset and collates them. With a
DataLoader of workers, the batches are fetched ahead by a DataLoader over the user's dataset, collate_fn, workers
and worker_init_fn, whose batch sampler is the engine's order cut at the engine's batch size, so workers run the
user's transforms while the GPU runs the step. The user's sampler and batch size are not used: the order is the
engine's and the batch is batch_size (the loader's own when batch_size is not given).

The workers collate each batch straight into a ring of shared-memory slots made once per source (_Ring), and send
back only the slot's number: the DataLoader's own way, a new shared-memory segment for every batch whose file
descriptor the main process receives, maps and first touches, took the main process most of a batch's time at
batch 512 and held the workers back (docs/results/python.md). The engine's thread copies the slot into pinned memory
(the GIL released) and the slot is free again. A batch that does not fit its slot (another shape or dtype, not two
tensors) comes the DataLoader's way; a ring larger than the host's shared memory allows is not made, and then two
threads of Served take the workers' batches as they come (one reads the loader, the other copies each batch out of
the shared memory it arrives in), so the engine's thread only pins and copies resident memory. No thread but the
engine's calls CUDA: the engine may be capturing its step in a CUDA graph meanwhile, and any CUDA call from another
thread breaks a capture. Pinning happens on the engine's thread, between steps.

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

# The share of the host's free shared memory (/dev/shm) and of its physical memory a source's ring may take.
RING_SHM_SHARE = 0.5
RING_RAM_SHARE = 0.125


class Served:
    """The engine's SampleSource for one split (called from C++ under the GIL)."""

    def __init__(self, dataset, collate_fn=None, num_workers=0, pin_memory=False, worker_init_fn=None,
                 split="train", prefetch_factor=None):
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
        self.prefetch_factor = prefetch_factor or 2  # the DataLoader's default
        self.order = list(range(len(dataset)))
        self._ordered = False  # epoch_begin came: the workers fetch ahead in its order
        self._loader = None    # the workers' DataLoader over self._batches, made once: its workers persist
        self._batches = _Batches(self)
        self._ahead = None     # the thread reading the workers' batches from offset self._next on
        self._next = None      # the offset of the next batch it yields
        self._size = None      # its batch size
        self._ring = None      # the workers' slots (_Ring), or None: batches come the DataLoader's way
        self._iter = None      # the loader's iterator over the ring's batches, from offset self._next on
        self._example = None   # one sample collated (inputs, targets), as the first look at the data gave it
        self.came = {"slot": 0, "batch": 0}  # the workers' batches by the way they came (for tests and probes)
        self.starts = 0        # iterations the workers were started on (for tests and probes)

    def size(self):
        return len(self.dataset)

    def epoch_begin(self, order):
        order = list(order)
        if self._next == 0 and (self._iter is not None or self._ahead is not None) and order == self.order:
            return  # the workers are on it already (epoch_ahead), nothing of it fetched yet
        self._ahead_stop()
        self._iter = None
        self.order = order
        self._ordered = True

    def epoch_ahead(self, order):
        """The next epoch's order, once this epoch's last batch was fetched: the workers start on it while the
        engine runs its last step and the evaluation (else the epoch would start on the time of one worker's whole
        batch)."""
        if self.num_workers == 0 or self._size is None:
            return
        self.epoch_begin(order)
        self._restart(0, self._size)

    def close(self):
        """Stops the thread that fetches ahead and the loader's workers (at the run's end)."""
        self._ahead_stop()
        self._iter = self._loader = self._ring = None  # its iterator's workers shut down with it

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
            last = offset + len(ids) == len(self.order) and len(ids) < (self._size or 0)  # the epoch's short end
            if self._next != offset or (self._size != len(ids) and not last) or (
                    self._ahead is None and self._iter is None):
                self._restart(offset, len(ids))
            self._next += len(ids)
            if self._iter is not None:
                got = next(self._iter, None)
                if got is None:
                    raise RuntimeError("the DataLoader ended before the epoch's last batch")
                return self._from_ring(got)
            return self._pinned(self._ahead.get())
        pair = self._pair(self.collate_fn([self.dataset[i] for i in ids]))
        if self._example is None and len(ids) == 1:
            self._example = pair
        return self._pinned(pair)

    def example(self):
        """One sample collated, (inputs, targets): the first look at the data's (cached), else sample 0's."""
        if self._example is None:
            self._example = self._pair(self.collate_fn([self.dataset[0]]))
        return self._example

    def _restart(self, offset, size):
        """The workers fetch ahead from `offset` on in batches of `size`: through the ring, made (with the loader
        and its workers, which persist across epochs) the first time and again when a batch outgrows its slots."""
        self._ahead_stop()
        self._iter = None
        self.starts += 1
        if self._loader is not None and self._ring is not None and size > self._ring.batch:
            self._loader = self._ring = None  # its workers hold the old ring: they shut down with the loader
        if self._loader is None:
            # No pin-memory thread of the loader's own: it calls CUDA (see the top of this file).
            self._ring = _Ring.made_for(self, size)
            dataset = self.dataset if self._ring is None else _RingDataset(self.dataset, self.collate_fn, self._ring)
            self._loader = DataLoader(dataset, batch_sampler=self._batches, num_workers=self.num_workers,
                                      collate_fn=self.collate_fn if self._ring is None else _as_is,
                                      pin_memory=False, worker_init_fn=self.worker_init_fn,
                                      prefetch_factor=self.prefetch_factor, persistent_workers=True)
        self._next, self._size = offset, size
        self._batches.start, self._batches.size, self._batches.numbered = offset, size, self._ring is not None
        if self._ring is not None:
            self._iter = iter(self._loader)
        else:
            self._ahead = _Ahead(self._loader, self._pair, depth=2 * self.num_workers)

    def _from_ring(self, got):
        """The batch a worker wrote into a slot, copied out (pinned on a GPU run), or one that came as it is."""
        kind, *rest = got
        self.came[kind] += 1
        if kind != "slot":
            return self._pinned(_private(self._pair(rest[0])))
        x, y = self._ring.take(*rest)
        return (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x.clone(), y.clone())


class _Ring:
    """Slots in shared memory, one batch each, that the workers collate into: batch k of an iteration goes to slot
    k % count. The DataLoader keeps at most prefetch_factor * workers batches dispatched beyond those it returned, and
    the engine copies each returned batch out before it asks for the next, so count = that + 2 slots are never
    written while read. Each slot's number records which batch is in it (checked when it is read)."""

    def __init__(self, example, batch, count):
        x, y = example
        self.batch, self.count = batch, count
        self.x = torch.empty((count, batch) + tuple(x.shape[1:]), dtype=x.dtype).share_memory_()
        self.y = torch.empty((count, batch) + tuple(y.shape[1:]), dtype=y.dtype).share_memory_()
        self.number = torch.full((count,), -1, dtype=torch.int64).share_memory_()

    @staticmethod
    def made_for(served, batch):
        """A ring for `served`'s batches of `batch` samples, or None where its shared memory would be too large a
        share of the host's (the batches then come the DataLoader's way)."""
        example = served.example()
        count = served.prefetch_factor * served.num_workers + 2
        per_batch = batch * sum(t[0].numel() * t.element_size() for t in example)
        limit = RING_RAM_SHARE * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        try:
            shm = os.statvfs("/dev/shm")
            limit = min(limit, RING_SHM_SHARE * shm.f_bavail * shm.f_frsize)
        except OSError:
            pass
        if count * per_batch > limit:
            return None
        return _Ring(example, batch, count)

    def fits(self, x, y):
        return (x.dtype == self.x.dtype and y.dtype == self.y.dtype and 0 < len(x) <= self.batch and
                len(y) == len(x) and x.shape[1:] == self.x.shape[2:] and y.shape[1:] == self.y.shape[2:])

    def put(self, number, pair):
        """In a worker: batch `number` into its slot; what the main process receives for it."""
        x, y = pair
        self.x[number % self.count, :len(x)].copy_(x)
        return self._targets_put(number, y)

    def _targets_put(self, number, y):
        """In a worker: batch `number`'s targets into its slot (its inputs written), the slot marked as holding
        it; what the main process receives for it."""
        slot = number % self.count
        self.y[slot, :len(y)].copy_(y)
        self.number[slot] = number
        return ("slot", slot, len(y), number)

    def stack(self, number, samples):
        """In a worker: default_collate's batch of (tensor, tensor or int) samples stacked straight into its slot,
        or None where the samples are of another kind or do not fit."""
        if not all(isinstance(s, (tuple, list)) and len(s) == 2 and torch.is_tensor(s[0]) for s in samples):
            return None
        first = samples[0][0]
        if (first.dtype != self.x.dtype or first.shape != self.x.shape[2:] or len(samples) > self.batch or
                any(s[0].shape != first.shape or s[0].dtype != first.dtype for s in samples)):
            return None
        ys = [s[1] for s in samples]
        if all(type(v) is int for v in ys):
            y = torch.tensor(ys)
        elif all(torch.is_tensor(v) for v in ys):
            y = torch.stack(ys)
        else:
            return None
        if y.dtype != self.y.dtype or y.shape[1:] != self.y.shape[2:]:
            return None
        torch.stack([s[0] for s in samples], out=self.x[number % self.count, :len(samples)])
        return self._targets_put(number, y)

    def take(self, slot, n, number):
        """The main process's view of batch `number` in `slot` (valid until it asks the loader for the next)."""
        if int(self.number[slot]) != number:
            raise RuntimeError(f"the DataLoader's slot {slot} holds batch {int(self.number[slot])}, not {number}: "
                               "a worker wrote it out of turn (please report this)")
        return self.x[slot, :n], self.y[slot, :n]


class _RingDataset(Dataset):
    """The user's dataset as the workers read it for a ring: a numbered batch of indices in, the batch collated into
    its slot out (or the batch itself where it does not fit)."""

    def __init__(self, dataset, collate_fn, ring):
        self.dataset, self.collate_fn, self.ring = dataset, collate_fn, ring

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, numbered):
        number, ids = numbered
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(ids) if getitems else [self.dataset[i] for i in ids]
        if self.collate_fn is default_collate:
            got = self.ring.stack(number, samples)
            if got is not None:
                return got
        batch = self.collate_fn(samples)
        if (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch) and
                self.ring.fits(*batch)):
            return self.ring.put(number, batch)
        return ("batch", batch)


def _as_is(batch):
    return batch


def _private(pair):
    """A batch of the DataLoader's own way copied out of the shared memory it arrived in (resident, private)."""
    x, y = pair
    return (x.clone(), y.clone()) if x.is_shared() else (x, y)


class _Batches:
    """The loader's batch sampler: the served order from `start` on, cut into batches of `size` (read when the
    loader starts an iteration), numbered for a ring."""

    def __init__(self, served):
        self.served, self.start, self.size = served, 0, 1
        self.numbered = False  # each batch as (its number in the iteration, indices): for a ring's workers

    def __iter__(self):
        order = self.served.order
        batches = [order[s:s + self.size] for s in range(self.start, len(order), self.size)]
        return iter(list(enumerate(batches)) if self.numbered else batches)

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
                    item = _private(prepare(item))
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
                        data.worker_init_fn, split, data.prefetch_factor)
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
