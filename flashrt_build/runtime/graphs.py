"""CUDA-graph replay of a package's calls: a decode step is hundreds of small
kernels, and launching them one by one costs more than running them.

Each method keeps a graph per distinct input shape, up to a bound: the first
call of a shape runs as it is (the warm-up: lazy initialisation, kernel
loading), the second captures a graph and replays it, and every later call of
that shape only replays. Capturing records kernels without running them, so
no call runs twice and state the package writes is written once per call.

A graph holds the device addresses of everything it reads and writes: the
inputs are copied into its own tensors, the bound weights and the state are
read where they are. Rebinding weights drops the graphs; writing the state in
place (a reset) keeps them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

log = logging.getLogger("flashrt_build")

# One call of the compiled code: flat tensors in, flat tensors out.
Run = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class Graph(Protocol):
    def replay(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


class CudaGraph:
    """One captured call. `copied`: the positions of `flat` that are the
    caller's inputs (copied in on replay); the others (threaded state) are
    the package's own tensors, read where they are."""

    def __init__(self, run: Run, flat: Sequence[torch.Tensor], copied: Sequence[int], copy_outputs: bool) -> None:
        self._static = list(flat)
        for i in copied:
            self._static[i] = flat[i].clone(memory_format=torch.contiguous_format)
        self._copied, self._copy_outputs = list(copied), copy_outputs
        self._graph = torch.cuda.CUDAGraph()
        # Thread-local: another thread's CUDA work does not invalidate the capture.
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
            self._outputs = run(list(self._static))  # boxed_run consumes its list

    def replay(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        for i in self._copied:
            self._static[i].copy_(flat[i], non_blocking=True)
        self._graph.replay()
        if not self._copy_outputs:  # the graph's own tensors: the next replay overwrites them
            return list(self._outputs)
        return [t.clone() for t in self._outputs]


Capture = Callable[[Run, Sequence[torch.Tensor], Sequence[int], bool], Graph]


class GraphCache:
    """The graphs of one method, by the shapes of its inputs."""

    def __init__(
        self,
        method: str,
        max_graphs: int,
        copy_outputs: bool = True,
        capture: Capture = CudaGraph,
    ) -> None:
        self.method, self.max_graphs, self.copy_outputs = method, max_graphs, copy_outputs
        self._capture = capture
        self.graphs: dict[tuple[tuple[int, ...], ...], Graph] = {}
        self._warmed: set[tuple[tuple[int, ...], ...]] = set()
        self.uncaptured_calls = 0  # calls that ran without a graph since the bound was reached
        self._said = False

    def __call__(self, run: Run, flat: list[torch.Tensor], copied: Sequence[int]) -> list[torch.Tensor]:
        key = tuple(tuple(flat[i].shape) for i in copied)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_graphs:
                self.uncaptured_calls += 1
                if not self._said:
                    self._said = True
                    log.warning(
                        "%s: %d CUDA graphs captured (serve.max_graphs, or load(max_graphs=)); inputs of other "
                        "shapes, like %s, run without one",
                        self.method,
                        len(self.graphs),
                        [list(shape) for shape in key],
                    )
                return run(flat)
            if key not in self._warmed:  # the first call of a shape: the warm-up
                self._warmed.add(key)
                return run(flat)
            graph = self.graphs[key] = self._capture(run, flat, copied, self.copy_outputs)
        return graph.replay(flat)

    def clear(self) -> None:
        """Drop every graph (they hold addresses of tensors no longer bound)."""
        self.graphs.clear()
        self._warmed.clear()
        self._said = False
        self.uncaptured_calls = 0
