"""Asynchronous rollouts (--max-staleness N): generation runs beside the update, from weights at most N updates old.

    step t's rollout is sampled from the weights published after step  max(t - 1 - lag, start - 1),
        lag = N // u  (u = optimizer updates per step: num_iterations x updates_per_generation)
so it is at most lag * u <= N updates older than the weights it trains, and which weights sample which step
does not depend on timing: a seeded asynchronous run is reproducible, and at N = 0 (lag 0) it computes the
synchronous loop's numbers. Each rollout carries `policy_version`, the optimizer updates its weights had seen;
the trainer checks staleness = updates now - policy_version on receipt and never trains on a rollout past N
(trl drops it; the schedule makes one impossible unless the generator is broken, so ours stops the run).

Two ways to run the generation:
    one process   `BackgroundRollouts`: a thread samples on its own copy of the policy; after each step the
                  trainer publishes a snapshot of the weights, the thread loads the one its next step needs
    torchrun      the last --generation-processes ranks only generate (`generation_loop`); rank 0 of the
                  training ranks sends them the weights through torch.distributed (send / recv) after each step
                  (`ProcessRollouts.publish`); each training rank reads its rows from the run's TCPStore, where
                  one of them put them (small: token ids and rewards)
Faults: an exception in the generator (thread or process) ends the run with its traceback named; a generation
process that dies or freezes (no heartbeat for HEARTBEAT_LIMIT_S) ends it within a minute. The heartbeat is a
thread: a generator stuck inside its own loop (a reward function that never returns) still beats, and the
training ranks wait for it. On a stop (SIGTERM,
--max-steps in pieces) the rollouts already sampled for later steps are discarded: a checkpoint holds the
weights and counters only, and the resumed run samples those steps again from the checkpoint's weights
(exact at N = 0, where nothing is sampled ahead).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
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
HEARTBEAT_LIMIT_S = 20.0  # ... and is declared dead when none came for this long
CHANNEL_TIMEOUT = datetime.timedelta(days=7)  # a generator waits for the next weights as long as a step takes


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
        # the copy keeps the policy's requires_grad flags (sampling runs without grad either way): torch's matmul
        # chooses its path by them, and on some CPUs (MKL on AMD EPYC) a product of fewer than 4 rows rounds
        # differently on a strided input than on a contiguous one, so the copy would sample what the policy would not
        self.model = copy.deepcopy(policy).eval()
        self.backend = make_backend(self.model)
        self.weights: dict[int, tuple[int, dict]] = {}  # steps done -> (policy version, weights)
        self.ready: dict[int, tuple] = {}  # step -> (collected, policy version)
        self.error: BaseException | None = None
        self._trace = ""
        self.stopping = False
        self.condition = threading.Condition()
        self.threads = torch.get_num_threads()  # a new thread's own count could round the sums differently
        self.thread = threading.Thread(target=self._run, name="grpo-rollouts", daemon=True)

    def begin(self, version: int, model: torch.nn.Module) -> None:
        """Publish the starting weights and start the thread."""
        self.publish(self.start, version, model)
        self.thread.start()

    def publish(self, steps_done: int, version: int, model: torch.nn.Module) -> None:
        """The weights after `steps_done` steps (`version` optimizer updates), for the steps that sample from them."""
        if steps_done != self.start and steps_done + self.lag >= self.total:  # no later step samples from them
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

    def close(self) -> None:
        """Stop the thread after the rollout it is sampling (rollouts sampled ahead are discarded)."""
        with self.condition:
            self.stopping = True
            self.condition.notify_all()
        if self.thread.is_alive():
            self.thread.join()
        if hasattr(self.backend, "close"):  # a vLLM server's backend leaves its weight-transfer group
            self.backend.close()

    def _run(self) -> None:
        try:
            torch.set_num_threads(self.threads)
            step = self.start
            while True:
                with self.condition:
                    done = weights_step(step, self.lag, self.start)
                    while not self.stopping and (step >= self.total or done not in self.weights):
                        self.condition.wait()
                    if self.stopping:
                        return
                    version, weights = self.weights[done]
                    for old in [d for d in self.weights if d < done]:  # no later step samples from these
                        del self.weights[old]
                self.model.load_state_dict(weights)
                self.backend.after_update()  # a backend with weights of its own (a vLLM server) loads them first
                collected = self.collect(step, self.backend)
                with self.condition:
                    self.ready[step] = (collected, version)
                    self.condition.notify_all()
                step += 1
        except BaseException as error:  # handed to the trainer, which raises it with this traceback
            self._trace = traceback.format_exc()
            with self.condition:
                self.error = error
                self.condition.notify_all()


# ----------------------------------------------------------------------------- torchrun: generation processes

def split_world(world, generation_processes: int):
    """(the training ranks' World, the generation ranks, the weights' channel): the last `generation_processes`
    ranks generate. Every rank calls it (new_group is collective). The channel is a gloo group of training rank 0
    and the generators: the weights travel as CPU tensors, which an NCCL group cannot carry, and a generator
    waits on it while the trainers train, evaluate and save, so its timeout is long (a dead peer is found by
    torchrun and the heartbeats instead)."""
    from grpo.parallel.distributed import World

    if generation_processes >= world.size:
        raise ValueError(f"--generation-processes {generation_processes} leaves no training process among "
                         f"{world.size}: launch more processes (torchrun --nproc-per-node)")
    trainers = list(range(world.size - generation_processes))
    group = dist.new_group(trainers)
    generators = list(range(world.size - generation_processes, world.size))
    channel = dist.new_group([0, *generators], backend="gloo", timeout=CHANNEL_TIMEOUT)
    training = World(rank=world.rank, size=len(trainers), local_rank=world.local_rank, group=group)
    return training, generators, channel


def generator_of(rank: int, generators: list[int]) -> int:
    """The generation rank that samples training rank `rank`'s rows."""
    return generators[rank % len(generators)]


def served_by(generator: int, generators: list[int], num_trainers: int) -> list[int]:
    return [rank for rank in range(num_trainers) if generator_of(rank, generators) == generator]


def _store():
    return dist.distributed_c10d._get_default_store()


def _header(obj) -> tuple[torch.Tensor, torch.Tensor]:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return torch.tensor([payload.numel()], dtype=torch.int64), payload


def _receive_header(src: int, channel):
    """A picklable message sent by `_Sender` (from training rank 0 of this same run)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=channel)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=channel)
    return pickle.loads(payload.numpy().tobytes())


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


class _Sender:
    """Training rank 0's messages to the generation ranks (weights, then stop), sent in order by a thread so that
    the loop goes on while a generation rank is still sampling with older weights."""

    def __init__(self, generators: list[int], channel):
        self.generators, self.channel, self.queue, self.error = generators, channel, [], None
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="grpo-weights", daemon=True)
        self.thread.start()

    def put(self, message, tensors: list[torch.Tensor] = ()) -> None:
        if self.error is not None:
            raise GenerationError(f"sending to the generation processes failed: {self.error}")
        with self.condition:
            self.queue.append((message, tensors))
            self.condition.notify()

    def _run(self) -> None:
        try:
            while True:
                with self.condition:
                    while not self.queue:
                        self.condition.wait()
                    message, tensors = self.queue.pop(0)
                for rank in self.generators:
                    for tensor in (*_header(message), *tensors):
                        dist.send(tensor, rank, group=self.channel)
                if message[0] == "stop":
                    return
        except Exception as error:  # a generation process that died; the loop names it (check_generators)
            self.error = error

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


class ProcessRollouts:
    """The training ranks' side: each rank reads its rows of every step from the store, written by its generation
    rank; training rank 0 sends the weights (fp32, one parameter after the other) after every step."""

    def __init__(self, world, generators: list[int], start: int, channel):
        self.world, self.generators, self.start = world, generators, start
        self.source = generator_of(world.rank, generators)
        self.sender = _Sender(generators, channel) if world.is_main else None

    def begin(self, version: int, model: torch.nn.Module) -> None:
        self.publish(self.start, version, model)

    def publish(self, steps_done: int, version: int, model: torch.nn.Module) -> None:
        """Every training rank (FSDP2 gathers the full weights); rank 0 sends them."""
        from grpo.parallel.distributed import full_tensor

        parts = []  # one full parameter at a time, freed at once: FSDP2 never holds the unsharded model
        for param in model.parameters():
            full = full_tensor(param.detach())  # FSDP2: a collective on every training rank
            if self.sender is not None:  # a copy on the CPU: the sender thread sends it while training goes on
                parts.append(full.to(device="cpu", dtype=torch.float32, copy=True))
        if self.sender is not None:
            self.sender.put(("weights", steps_done, version), parts)

    def get(self, step: int) -> tuple:
        """(collected, policy version) of `step`, checking every second that the generation process is alive."""
        store, key = _store(), f"grpo/rollout/{self.world.rank}/{step}"
        while True:
            try:
                store.wait([key], datetime.timedelta(seconds=1))
                break
            except (RuntimeError, dist.DistStoreError):  # not there yet
                check_generators([self.source])
                if self.sender is not None and self.sender.error is not None:
                    check_generators(self.generators)
                    raise GenerationError(f"generation process (rank {', '.join(map(str, self.generators))}) is gone: "
                                          f"sending it the weights failed: {self.sender.error}") from None
        message = pickle.loads(store.get(key))  # from a rank of this same run (torchrun's own processes)
        store.delete_key(key)
        return message

    def close(self) -> None:
        """Tell the generation ranks to stop (rank 0); the rows they sampled ahead are discarded."""
        if self.sender is not None and self.sender.error is None:  # (an error was raised by get already)
            self.sender.put(("stop",))
            self.sender.join(timeout=60)


def on_cpu(rollout):
    """The rollout with its tensors on the CPU (a GPU generator's rows would otherwise unpickle onto its GPU)."""
    return dataclasses.replace(rollout, **{f.name: getattr(rollout, f.name).cpu() for f in dataclasses.fields(rollout)
                                           if isinstance(getattr(rollout, f.name), torch.Tensor)})


def generation_loop(collect, model: torch.nn.Module, rank: int, generators: list[int], num_trainers: int,
                    start: int, total: int, lag: int, channel, on_weights=lambda: None) -> None:
    """A generation rank: for every step, wait for the weights it samples from (messages from training rank 0,
    applied in order; `on_weights()` after each, for a backend with its own copy), sample each served training
    rank's rows (`collect(step, trainer_rank)`), and put them in the store for that rank. Ends at training rank 0's
    stop."""
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
    done, version = start - 1, 0

    def next_message() -> bool:  # apply the next weights; False at the stop
        nonlocal done, version
        message = _receive_header(0, channel)
        if message[0] == "stop":
            return False
        _, done, version = message
        with torch.no_grad():  # one parameter at a time (fp32), each into its place: no whole-model buffer
            for param in params:
                received = torch.empty(param.shape, dtype=torch.float32)
                dist.recv(received, 0, group=channel)
                param.copy_(received)
        on_weights()
        return True

    try:
        for step in range(start, total):
            while done < weights_step(step, lag, start):
                if not next_message():
                    return
            for trainer in served:  # the rows on the CPU: a training rank loads them onto its own device
                rollout, *rest = collect(step, trainer)
                message = ((on_cpu(rollout), *rest), version)
                store.set(f"grpo/rollout/{trainer}/{step}", pickle.dumps(message))
        while next_message():  # every step is sampled: the weights sent meanwhile are not needed
            pass
    except BaseException:
        store.set(f"grpo/generation/{rank}/error", traceback.format_exc())
        raise
    finally:
        beating.set()
