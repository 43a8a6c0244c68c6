"""A training run's session: the accelerator, the run folder it owns, logging, and what is checked before
any work. Every recipe starts one.

``Session.start`` does, in order: the hub token and repo (before any work, no network), the run folder
(refused when it holds another run), the model config against ``max_length`` (and a composite checkpoint against
what this version trains it with), the distributed debug
variables and trackers (checked installed), the accelerator (FSDP2 through Accelerate, on GPU or
CPU/gloo), the run-folder lock (rank 0, before anything is written; its refusal raised on every rank),
the resolved config written into the folder, and the seed. Leaving the ``with`` block releases the lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from hf_fsdp2 import collectives
from hf_fsdp2.checkpoint.layout import CheckpointError
from hf_fsdp2.checkpoint.run_dir import RunLock, check_output_dir, claim_auto, clear_previous_run
from hf_fsdp2.collectives import broadcast_object, rank0_decides
from hf_fsdp2.compat import check_versions
from hf_fsdp2.composite import check_composite_run
from hf_fsdp2.config import CONFIG_NAME, Config, ConfigError, save_config
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan, check, check_mesh
from hf_fsdp2.elastic.agent import (
    ARRIVAL_S,
    AUTO,
    AgentLaunch,
    ResumeSetting,
    attempt_init_method,
    check_arrival,
    check_max_restarts,
    resume_setting,
)
from hf_fsdp2.elastic.attempts import read_layout
from hf_fsdp2.elastic.progress import PROGRESS
from hf_fsdp2.elastic.watchdog import Watchdog, describe_watchdog, flight_recorder_env
from hf_fsdp2.export.hub import check_can_push
from hf_fsdp2.model import check_max_length, load_model_config, meta_model, text_config
from hf_fsdp2.observe.profiling import apply_distributed_debug
from hf_fsdp2.observe.trackers import build_trackers
from hf_fsdp2.parallel.accelerator import (
    build_accelerator,
    describe_policy,
    has_accelerator_device,
    launcher_mesh,
    local_world_size,
    setup_logging,
    world_size,
)
from hf_fsdp2.parallel.expert_shard import ExpertMeshes
from hf_fsdp2.parallel.experts import check_expert_parallel
from hf_fsdp2.parallel.kernels import check_liger_available
from hf_fsdp2.parallel.launch_config import find_launch_request, fsdp_findings, world_findings
from hf_fsdp2.parallel.tensor import check_tp_settings

logger = logging.getLogger("hf_fsdp2")


def claim_output_dir(lock: RunLock, setting: ResumeSetting, current: dict[str, Any]) -> str | None:
    """Rank 0: lock the run folder, then check it holds no other run (an overwritten one loses everything the
    previous run wrote); the lock is dropped on refusal. Returns what the run resumes from: the checkpoint that
    ``auto`` found (None: a fresh start), or the setting's own value."""
    lock.acquire()
    folder = lock.path.parent
    try:
        resume = setting.resume is not None
        check_output_dir(folder, overwrite=setting.overwrite, resume=resume)
        if setting.overwrite and not resume:
            clear_previous_run(folder)
        if setting.resume == AUTO:
            found = claim_auto(folder, current)
            return str(found) if found is not None else None
    except (ConfigError, CheckpointError):
        lock.release()
        raise
    return setting.resume


@dataclass(kw_only=True)
class Session:
    """One run: its config, accelerator, run folder (owned), and plans. Create with :meth:`start`."""

    cfg: Config
    accelerator: Accelerator
    output_dir: Path
    sharding: ShardingPlan
    compile_plan: CompilePlan
    model_config: Any
    hub_token: str | None
    lock: RunLock
    launch: AgentLaunch
    watchdog: Watchdog
    # The checkpoint this attempt resumes ("latest" or a folder; None: a fresh start), and whether
    # resume_from_checkpoint=auto found it (then it must be this run's).
    resume_from: str | None = None
    resume_auto: bool = False
    # The start-up memory plan (rank 0 only; None on other ranks and where it could not be made): advice, read by
    # choices rank 0 makes and shares (GRPO colocate's sleep mode).
    memory_plan: Any = None
    started: float = field(default_factory=time.perf_counter)
    expert_meshes: ExpertMeshes | None = (
        None  # expert parallel's meshes, built once (run/build.py:expert_plan)
    )

    @classmethod
    def start(cls, cfg: Config) -> Session:
        """Check everything that can be checked before any work, build the accelerator, own the run folder.

        Raises:
            ConfigError / HubError / KernelError / FileNotFoundError: bad input, before any work.
            VersionError: torch / transformers / accelerate older than the tested floor (hf_fsdp2.compat).
        """
        started = time.perf_counter()
        check_versions()
        m, d, t, f, e, o = cfg.model, cfg.data, cfg.train, cfg.fsdp, cfg.export, cfg.observe
        # Hub: repo id, offline mode and token are checked before any work (every rank, no network).
        pushes = e.push_to_hub or e.push_checkpoints_to_branch
        hub_token = check_can_push(e.hub_model_id, e.hub_token) if pushes else None
        e.hub_token = None  # never written to disk: resolved config, checkpoints, model card
        output_dir = Path(t.output_dir or "")
        # The elastic agent's restarts (the launcher's --max_restarts: a recipe asking for others is refused), and
        # where this attempt resumes: a run with restarts continues its own newest checkpoint (auto).
        agent = AgentLaunch.from_env()
        check_max_restarts(cfg.restart.max_restarts, agent)
        setting = resume_setting(t.resume_from_checkpoint, overwrite=t.overwrite_output_dir, launch=agent)
        check_output_dir(output_dir, overwrite=setting.overwrite, resume=setting.resume is not None)
        model_config = load_model_config(
            m.model_name_or_path or "", revision=m.model_revision, trust_remote_code=m.trust_remote_code
        )
        check_max_length(d.max_length, model_config)
        # Debug variables before the process group exists; trackers (checked installed) before any work.
        debug_env = apply_distributed_debug(o.distributed_debug, output_dir / "debug")
        # The flight recorder, whose record of each rank's last collectives the hang watchdog dumps with its stacks.
        debug_env += flight_recorder_env(output_dir / "debug") if cfg.restart.hang_timeout != 0 else []
        trackers = build_trackers(
            o.report_to,
            output_dir / "tensorboard",
            project=o.tracker_project,
            run_name=o.run_name or output_dir.name,
        )
        on_gpu = has_accelerator_device()
        if t.use_liger_kernel:  # package and GPU checked before any work
            check_liger_available(on_gpu)
        ram_efficient_set = f.fsdp_cpu_ram_efficient_loading  # None: unset (tensor parallel turns it off)
        # Before the plan and the model loads read it; the resolved value is what the saved config holds.
        loading_note = f.resolve_ram_efficient_loading(
            local_world_size(),
            resize_embeddings=m.resize_token_embeddings,
            load_in_4bit=cfg.peft.load_in_4bit,
            float8=t.mixed_precision == "fp8",
        )
        sharding, compile_plan = f.sharding_plan(on_gpu=on_gpu), f.compile_plan(on_gpu=on_gpu)
        # The device mesh: its sizes against the world size and the model, before the process group exists.
        mesh = f.mesh_plan(world_size(), launcher_mesh())
        # A composite checkpoint: what this version cannot train it with (the class itself is decided from the
        # config on every rank, in load_model).
        check_composite_run(
            model_config,
            tp_size=mesh.tp,
            cp_size=mesh.cp,
        )
        check_mesh(
            mesh,
            heads=getattr(text_config(model_config), "num_attention_heads", None),
            kv_heads=getattr(text_config(model_config), "num_key_value_heads", None),
            max_length=d.max_length,
        )
        # Expert parallel: the model's experts read from its config on the meta device (nothing loaded), every rank.
        experts = (
            check_expert_parallel(meta_model(model_config, trust_remote_code=m.trust_remote_code), mesh)
            if mesh.ep > 1
            else None
        )
        tp_off = check_tp_settings(
            mesh.tp,
            use_peft=cfg.peft.use_peft,
            load_in_4bit=cfg.peft.load_in_4bit,
            liger=t.use_liger_kernel,
            ram_efficient_loading=ram_efficient_set,
        )
        if mesh.tp > 1:  # what tensor parallel turns off (set to true, refused above)
            f.fsdp_cpu_ram_efficient_loading = False
            sharding = f.sharding_plan(on_gpu=on_gpu)
            loading_note = tp_off.get("fsdp_cpu_ram_efficient_loading", loading_note)
        check(
            not (cfg.peft.load_in_4bit and mesh.hybrid),
            f"load_in_4bit=true with HSDP (dp_replicate_size={mesh.dp_replicate}) is not supported: the NF4 "
            "tensor all-gathers over one flat group; use dp_replicate_size=1",
        )
        # The launch's own accelerate config (FSDP1 keys mapped or refused) and world, before the process group.
        request = find_launch_request()
        devices = torch.cuda.device_count() if on_gpu and torch.cuda.is_available() else 0
        launch = fsdp_findings(request.settings, cfg) if request is not None and request.settings else []
        launch += world_findings(
            request,
            world=world_size(),
            local_world=local_world_size(),
            devices=devices,
            strict=t.strict_launch,
        )
        refused = [x.line() for x in launch if x.level == "error"]
        check(not refused, "the launch cannot run as asked:\n  " + "\n  ".join(refused))
        # A restarted attempt on several nodes: every rank here before the process group, or the ones missing named.
        arrival = check_arrival(
            agent, timeout_s=min(float(t.ddp_timeout), ARRIVAL_S), layout=read_layout(output_dir)
        )
        accelerator = build_accelerator(
            sharding,
            mixed_precision=t.mixed_precision,
            compile_plan=compile_plan,
            timeout_s=t.ddp_timeout,
            host_timeout_s=t.host_wait_timeout,
            log_with=trackers,
            mesh=mesh,
            init_method=attempt_init_method(agent),
        )
        del arrival  # rank 0's store for this attempt: the process group's rendezvous has taken it over
        setup_logging(accelerator.is_main_process)
        logger.info(
            "collective timeout ddp_timeout=%ds, waits for rank 0 (host group) host_wait_timeout=%ds; debug variables: %s",
            t.ddp_timeout,
            t.host_wait_timeout,
            ", ".join(debug_env) or "none (distributed_debug=off)",
        )
        logger.info("%s", loading_note)
        logger.info("device mesh: %s", mesh.describe())
        if experts is not None:
            logger.info("%s", experts.describe(mesh.ep, mesh.efsdp))
        if launch:
            where = f" ({request.source})" if request is not None else ""
            logger.info(
                "accelerate launch read as FSDP2%s:\n  %s", where, "\n  ".join(x.line() for x in launch)
            )
            for finding in launch:
                if finding.level == "warning":
                    logger.warning("%s", finding.line())
        if t.mixed_precision == "no" and m.torch_dtype != "float32":
            logger.warning(
                "mixed_precision=no with torch_dtype=%s trains in %s throughout (no fp32 master weights); "
                "use mixed_precision=bf16 for bf16 compute with fp32 master weights",
                m.torch_dtype,
                m.torch_dtype,
            )
        # Rank 0 takes the run folder (an exclusive lock) before anything is written, then checks it again:
        # another run may have used it since the first check. Its refusal is raised on every rank.
        lock = RunLock(output_dir)
        decided: list[str | None] = [None]

        def claim() -> None:
            decided[0] = claim_output_dir(lock, setting, cfg.to_flat_dict())

        rank0_decides(claim)
        resume_from = broadcast_object(decided[0])  # what rank 0 found under the lock, on every rank
        PROGRESS.reset(output_dir)
        watchdog = Watchdog(
            timeout_s=cfg.restart.hang_timeout,
            output_dir=output_dir,
            rank=accelerator.process_index,
            world=accelerator.num_processes,
        )
        session = cls(
            cfg=cfg,
            accelerator=accelerator,
            output_dir=output_dir,
            sharding=sharding,
            compile_plan=compile_plan,
            model_config=model_config,
            hub_token=hub_token,
            lock=lock,
            launch=agent,
            watchdog=watchdog,
            resume_from=resume_from,
            resume_auto=setting.resume == AUTO,
            started=started,
        )
        try:
            if accelerator.is_main_process:
                save_config(cfg, output_dir / CONFIG_NAME)
            if o.distributed_debug == "detail":
                (output_dir / "debug").mkdir(
                    parents=True, exist_ok=True
                )  # every rank (node): flight recorder
            set_seed(t.seed)
            logger.info(
                "world size %d on %s; mixed precision %s", session.world, session.device, t.mixed_precision
            )
            logger.info("restarts: %s", agent.describe())
            watchdog.start()
            logger.info("hang watchdog: %s", describe_watchdog(cfg.restart.hang_timeout))
            if setting.note:
                logger.info("%s", setting.note)
            logger.info(
                "FSDP2 mixed-precision policy: %s",
                describe_policy(accelerator.state.fsdp_plugin.mixed_precision_policy),
            )
        except BaseException:
            watchdog.stop()
            lock.release()
            raise
        return session

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.watchdog.stop()
        self.lock.release()

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def data_rank(self) -> int:
        """Which batches this rank reads (ranks of one context/tensor-parallel group read the same)."""
        return collectives.data_rank()

    @property
    def data_world(self) -> int:
        """Ranks that read different batches: world / (cp_size x tp_size)."""
        return collectives.data_world()

    @property
    def data_ranks_named(self) -> str:
        """The data-parallel rank count as messages name it."""
        if self.data_world == self.world:
            return f"world_size({self.world})"
        return f"data-parallel ranks({self.data_world} = world_size {self.world} / (cp_size x tp_size))"

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the model computes in under the run's mixed precision (None: its weights' dtype)."""
        return torch.bfloat16 if self.cfg.train.mixed_precision in ("bf16", "fp8") else None
