"""Data from PyTorch for the engine: a torch.utils.data.Dataset of (input, target) pairs, or a DataLoader.

The engine draws each epoch's order itself (seeded: the same order on resume and on every device) and asks for the
samples [offset, offset + count) of that order; Served fetches them from the dataset and collates them. With a
DataLoader of workers, the batches are fetched ahead by a DataLoader over the user's dataset, collate_fn, workers,
pin_memory and worker_init_fn, whose batch sampler is the engine's order cut at the engine's batch size, so workers
run the user's transforms while the GPU runs the step. The user's sampler and batch size are not used: the order is
the engine's and the batch is batch_size (the loader's own when batch_size is not given).
"""
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

__all__ = ["Served", "served_from"]


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
        self._iter = None      # the workers' DataLoader over the order, from self._next
        self._next = None      # the offset of the next batch it yields
        self._size = None      # its batch size

    def size(self):
        return len(self.dataset)

    def epoch_begin(self, order):
        self.order = list(order)
        self._ordered = True
        self._iter = None

    def _pair(self, batch):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch)):
            raise TypeError(f"{self.split} data: a batch must collate to (inputs, targets), two tensors; got "
                            f"{type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list))
                                                          else ""))
        x, y = (t.contiguous() for t in batch)
        if self.pin_memory and not x.is_pinned():
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def fetch(self, offset, ids):
        if self.num_workers > 0 and self._ordered and list(self.order[offset:offset + len(ids)]) == list(ids):
            if self._iter is None or self._next != offset or self._size != len(ids):
                starts = range(offset, len(self.order), len(ids))
                sampler = [self.order[s:s + len(ids)] for s in starts]
                # No pin-memory thread: it calls CUDA while the engine captures its step in a CUDA graph, which
                # breaks the capture (and the context with it); _pair pins on the engine's thread, between steps.
                loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers,
                                    collate_fn=self.collate_fn, pin_memory=False,
                                    worker_init_fn=self.worker_init_fn)
                self._iter, self._next, self._size = iter(loader), offset, len(ids)
            batch = next(self._iter)
            self._next += len(ids)
            return self._pair(batch)
        return self._pair(self.collate_fn([self.dataset[i] for i in ids]))


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
