"""A per-rank start-up hook (``NBDDP_RANK_HOOK``) that gives a CPU rank GPU memory counters.

torch.cuda's peak counters are stubbed: rank r's allocated peak is ``(r + 1) * resets`` GiB and
its reserved peak 0.5 GiB more, ``resets`` counting ``reset_peak_memory_stats`` calls. nbddp's
memory helpers are pointed at ``cuda:0`` so that the built-in worker on CPU ranks reads them
(and nothing else of CUDA). Rank 1's values are the higher ones: a record that shows them took
the highest over the ranks, not rank 0's.
"""


def install(rank):
    import torch

    from nbddp.rank import engine
    from nbddp.tasks.classification import worker as classification

    resets = [0]

    def reset_peak_memory_stats(device=None):
        resets[0] += 1

    torch.cuda.reset_peak_memory_stats = reset_peak_memory_stats
    torch.cuda.max_memory_allocated = lambda device=None: (rank + 1) * resets[0] * 2**30
    torch.cuda.max_memory_reserved = lambda device=None: ((rank + 1) * resets[0] + 0.5) * 2**30
    cuda0 = torch.device("cuda", 0)
    peaks, reset = engine.gpu_memory_peaks, engine.reset_gpu_memory_peaks
    engine.gpu_memory_peaks = lambda device: peaks(cuda0)
    engine.reset_gpu_memory_peaks = classification.reset_gpu_memory_peaks = lambda device: reset(cuda0)
