"""Asynchronous rollouts (--max-staleness N): generation runs beside the update, from weights at most N updates old.

    step t's rollout is sampled from the weights published after step  max(t - 1 - lag, start - 1),
        lag = N // u  (u = optimizer updates per step: num_iterations x updates_per_generation)
so it is at most lag * u <= N updates older than the weights it trains, and which weights sample which step
does not depend on timing: a seeded asynchronous run is reproducible, and at N = 0 (lag 0) it computes the
synchronous loop's numbers. Each rollout carries `policy_version`, the optimizer updates its weights had seen;
the trainer checks staleness = updates now - policy_version on receipt and drops a rollout past N, as trl's
AsyncGRPOTrainer drops stale samples, sampling that step again from the current weights (`sample/dropped_stale_total`).

Two ways to run the generation:
    one process   `BackgroundRollouts`: a thread samples on its own copy of the policy; after each step the
                  trainer publishes a snapshot of the weights, the thread loads the one its next step needs
    torchrun      the last --generation-processes ranks only generate (`generation_loop`); rank 0 of the
                  training ranks sends them the weights through torch.distributed after each step
                  (`ProcessRollouts.publish`), each training rank receives its rows from one of them
Faults: an exception in the generator (thread or process) ends the run with its traceback named; a generation
process that dies or hangs (no heartbeat for HEARTBEAT_LIMIT_S) ends it within a minute. On a stop (SIGTERM,
--max-steps in pieces) the rollouts already sampled for later steps are discarded: a checkpoint holds the
weights and counters only, and the resumed run samples those steps again from the checkpoint's weights
(exact at N = 0, where nothing is sampled ahead).
"""

from __future__ import annotations

import copy
import logging
import pickle
import signal
import threading
import time
import traceback

import torch
import torch.distributed as dist

logger = logging.getLogger("grpo")

HEARTBEAT_S = 2.0  # a generation process writes its heartbeat this often
HEARTBEAT_LIMIT_S = 30.0  # ... and is declared dead when none came for this long
_POLL_S = 0.01


class GenerationError(RuntimeError):
    """The generator failed or died: the run stops (the last checkpoint is kept)."""


def steps_ahead(max_staleness: int, updates_per_step: int) -> int:
    """lag: how many steps before its own step a rollout may be sampled, keeping staleness <= max_staleness."""
    return max_staleness // max(updates_per_step, 1)


def weights_step(step: int, lag: int, start: int) -> int:
    """The steps done when the weights that sample `step` were published (start: the run's first step)."""
    return max(step - lag, start)


def is_stale(policy_version: int, updates: int, max_staleness: int) -> bool:
    """trl's rule: a rollout whose weights are more than max_staleness updates old is dropped."""
    return updates - policy_version > max_staleness


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# ----------------------------------------------------------------------------- one process: a background thread

class BackgroundRollouts:
    """A thread that samples each step's rollout on its own copy of the policy.

    `collect(step, backend)` samples and scores step `step`'s rows with a generation backend (the trainer's
    Trainer.collect_rollout); `make_backend(model)` builds the thread's backend on the copy. `publish(steps_done,
    version, model)` after every step; `get(step)` waits for a step's rollout.
    """

    def __init__(self, collect, make_backend, policy: torch.nn.Module, start: int, total: int, lag: int):
        self.collect, self.start, self.total, self.lag = collect, start, total, lag
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.backend = make_backend(self.model)
        self.weights: dict[int, tuple[int, dict]] = {}  # steps done -> (policy version, weights)
        self.ready: dict[int, tuple] = {}  # step -> (collected, policy version)
        self.redo: list[int] = []  # steps to sample again from the newest weights (a stale rollout)
        self.error: BaseException | None = None
        self._trace = ""
        self.stopping = False
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="grpo-rollouts", daemon=True)

    def begin(self, version: int, model: torch.nn.Module) -> None:
        """Publish the starting weights and start the thread."""
        self.publish(self.start, version, model)
        self.thread.start()

    def publish(self, steps_done: int, version: int, model: torch.nn.Module) -> None:
        """The weights after `steps_done` steps (`version` optimizer updates), for the steps that sample from them."""
        needed = any(weights_step(t, self.lag, self.start) == steps_done for t in range(steps_done, self.total))
        if not needed and steps_done != self.start:
            return
        weights = snapshot(model)
        with self.condition:
            self.weights[steps_done] = (version, weights)
            self.condition.notify_all()

    def get(self, step: int) -> tuple:
        """(collected, policy version) of `step`, waiting for the thread; its error if it failed."""
        with self.condition:
            while step not in self.ready and self.error is None:
                self.condition.wait(timeout=1.0)
                if not self.thread.is_alive() and step not in self.ready and self.error is None:
                    self.error = GenerationError("the rollout thread ended without a rollout")
            if self.error is not None:
                raise GenerationError(f"generation failed: {self.error!r}\n{self._trace}") from self.error
            return self.ready.pop(step)

    def resample(self, step: int) -> None:
        """Sample `step` again from the newest weights (its rollout was stale)."""
        with self.condition:
            self.redo.append(step)
            self.condition.notify_all()

    def close(self) -> None:
        """Stop the thread after the rollout it is sampling (rollouts sampled ahead are discarded)."""
        with self.condition:
            self.stopping = True
            self.condition.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        try:
            step = self.start
            while True:
                with self.condition:
                    while not self.stopping and not self.redo and (step >= self.total or weights_step(
                            step, self.lag, self.start) not in self.weights):
                        self.condition.wait()
                    if self.stopping:
                        return
                    if self.redo:  # a stale rollout: that step again, from the newest weights
                        target = self.redo.pop(0)
                        version, weights = self.weights[max(self.weights)]
                    else:
                        target = step
                        done = weights_step(step, self.lag, self.start)
                        version, weights = self.weights[done]
                        for old in [d for d in self.weights if d < done]:  # no later step samples from these
                            del self.weights[old]
                self.model.load_state_dict(weights)
                collected = self.collect(target, self.backend)
                with self.condition:
                    self.ready[target] = (collected, version)
                    self.condition.notify_all()
                if target == step:
                    step += 1
        except BaseException as error:  # handed to the trainer, which raises it with this traceback
            self._trace = traceback.format_exc()
            with self.condition:
                self.error = error
                self.condition.notify_all()


# ----------------------------------------------------------------------------- torchrun: generation processes

def split_world(world, generation_processes: int):
    """(the training ranks' World, the generation ranks): the last `generation_processes` ranks generate.
    Every rank calls it (new_group is collective)."""
    from grpo.loop.distributed import World

    if generation_processes >= world.size:
        raise ValueError(f"--generation-processes {generation_processes} leaves no training process among "
                         f"{world.size}: launch more processes (torchrun --nproc-per-node)")
    trainers = list(range(world.size - generation_processes))
    group = dist.new_group(trainers)
    generators = list(range(world.size - generation_processes, world.size))
    training = World(rank=world.rank, size=len(trainers), local_rank=world.local_rank, group=group)
    return training, generators


def generator_of(rank: int, generators: list[int]) -> int:
    """The generation rank that samples training rank `rank`'s rows."""
    return generators[rank % len(generators)]


def served_by(generator: int, generators: list[int], num_trainers: int) -> list[int]:
    return [rank for rank in range(num_trainers) if generator_of(rank, generators) == generator]


def _store():
    return dist.distributed_c10d._get_default_store()


def _send(obj, dst: int) -> list:
    """Send a picklable object (header: its byte count) without waiting; returns the handles to wait on."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    header = torch.tensor([payload.numel()], dtype=torch.int64)
    return [dist.isend(header, dst), dist.isend(payload, dst), payload, header]


def _wait(work, peer: int) -> None:
    """Wait for a send or receive with `peer`, checking every second that the generation process is alive."""
    checked = time.monotonic()
    while not work.is_completed():
        if time.monotonic() - checked > 1.0:
            check_generators([peer])
            checked = time.monotonic()
        time.sleep(_POLL_S)
    try:
        work.wait()
    except RuntimeError as error:
        check_generators([peer])
        raise GenerationError(f"process {peer}: {error}") from error


def _receive(src: int, watch: bool):
    header = torch.zeros(1, dtype=torch.int64)
    work = dist.irecv(header, src)
    _wait(work, src) if watch else work.wait()
    payload = torch.empty(int(header.item()), dtype=torch.uint8)
    work = dist.irecv(payload, src)
    _wait(work, src) if watch else work.wait()
    return pickle.loads(payload.numpy().tobytes())  # from a rank of this same run (torchrun's own processes)


def check_generators(ranks: list[int]) -> None:
    """Raise GenerationError naming the cause when a generation process reported an error, or has not beaten
    for HEARTBEAT_LIMIT_S (killed, or hung)."""
    store = _store()
    for rank in ranks:
        if store.check([f"grpo/generation/{rank}/error"]):
            cause = store.get(f"grpo/generation/{rank}/error").decode()
            raise GenerationError(f"generation process (rank {rank}) failed:\n{cause}")
        if store.check([f"grpo/generation/{rank}/alive"]):
            age = time.time() - float(store.get(f"grpo/generation/{rank}/alive").decode())
            if age > HEARTBEAT_LIMIT_S:
                raise GenerationError(f"generation process (rank {rank}) died or hangs: no heartbeat for {age:.0f} s")


class ProcessRollouts:
    """The training ranks' side: receive each step's rows from a generation rank; rank 0 publishes weights."""

    def __init__(self, world, generators: list[int], start: int, total: int, lag: int):
        self.world, self.generators, self.start, self.total, self.lag = world, generators, start, total, lag
        self.source = generator_of(world.rank, generators)
        self.received = start  # the next step whose rows this rank has not received
        self.published = start - 1  # the last steps_done sent to the generators
        self.pending: list = []

    def begin(self, version: int, model: torch.nn.Module) -> None:
        self.publish(self.start, version, model)

    def publish(self, steps_done: int, version: int, model: torch.nn.Module) -> None:
        """Every training rank (FSDP2 gathers the full weights), rank 0 sends them to every generation rank."""
        from grpo.loop.distributed import full_tensor

        flat = torch.cat([full_tensor(p.detach()).reshape(-1).float().cpu() for p in model.parameters()])
        if self.world.is_main:
            for work in self.pending:
                if hasattr(work, "is_completed"):
                    _wait(work, self.generators[0])
            self.pending = []
            for rank in self.generators:
                self.pending += _send(("weights", steps_done, version), rank) + [dist.isend(flat, rank), flat]
        self.published = steps_done

    def get(self, step: int) -> tuple:
        """(collected, policy version) of `step` (received in step order)."""
        if step != self.received:
            raise RuntimeError(f"rollouts arrive in step order: expected step {self.received}, asked for {step}")
        message = _receive(self.source, watch=True)
        if message[0] == "error":
            raise GenerationError(f"generation process (rank {self.source}) failed:\n{message[1]}")
        _, sampled_step, collected, version = message
        assert sampled_step == step, (sampled_step, step)
        self.received += 1
        return collected, version

    def resample(self, step: int) -> None:
        raise GenerationError(f"step {step}'s rollout arrived staler than --max-staleness from a generation process: "
                              "the weights must reach it after every step")

    def close(self) -> None:
        """Discard the rows sampled ahead (every step the published weights allow), then tell the generators to
        stop (rank 0)."""
        last = min(self.published + self.lag, self.total - 1)
        try:
            for step in range(self.received, last + 1):
                self.get(step)
            if self.world.is_main:
                for rank in self.generators:
                    for work in _send(("stop",), rank)[:2]:
                        _wait(work, rank)
                for work in self.pending:
                    if hasattr(work, "is_completed"):
                        _wait(work, self.generators[0])
        except GenerationError as error:
            logger.warning("closing the generation processes: %s", error)


@torch.no_grad()
def load_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat fp32 vector (the parameters laid end to end) into `params`, each keeping its dtype and device."""
    offset = 0
    for param in params:
        param.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()


def generation_loop(collect, model: torch.nn.Module, rank: int, generators: list[int], num_trainers: int,
                    start: int, total: int, lag: int) -> None:
    """A generation rank: for every step, wait for the weights it samples from (messages from training rank 0,
    applied in order), sample each served training rank's rows (`collect(step, trainer_rank)`), send them."""
    store = _store()
    beating = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # torchrun signals every rank: the training ranks say when to stop
        signal.signal(sig, signal.SIG_IGN)

    def heartbeat():
        while not beating.wait(HEARTBEAT_S):
            store.set(f"grpo/generation/{rank}/alive", str(time.time()))

    store.set(f"grpo/generation/{rank}/alive", str(time.time()))
    threading.Thread(target=heartbeat, daemon=True).start()
    served = served_by(rank, generators, num_trainers)
    params = list(model.parameters())
    done, version, pending = start - 1, 0, []
    try:
        for step in range(start, total):
            while done < weights_step(step, lag, start):
                message = _receive(0, watch=False)
                if message[0] == "stop":
                    return
                _, done, version = message
                flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
                dist.recv(flat, 0)
                load_flat(params, flat)
            for trainer in served:
                pending += _send(("rollout", step, collect(step, trainer), version), trainer)
        while True:  # the last steps are sampled: wait for the stop (weights published meanwhile are dropped)
            message = _receive(0, watch=False)
            if message[0] == "stop":
                break
            dist.recv(torch.empty(sum(p.numel() for p in params), dtype=torch.float32), 0)
        for work in pending:
            if hasattr(work, "is_completed"):
                work.wait()
    except BaseException:
        store.set(f"grpo/generation/{rank}/error", traceback.format_exc())
        raise
    finally:
        beating.set()
