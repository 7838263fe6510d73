"""What the Trainer integration changes on its Accelerator (nothing here imports transformers).

With ``zero_offload`` the engine owns loss scaling, the gradient reduction, the clipping and the optimizer state, so
four of Accelerate's steps change: backward scales the loss by the engine's scale; the model gets no DDP wrapper; the
optimizer is wrapped without device placement, and reports the engine's skipped (fp16 overflow) steps as
Accelerate's own; ``clip_grad_norm_`` on the engine's params has the engine clip at its step (its ``.grad`` is
gone). ``adapt_accelerator`` makes the same changes for a training loop of one's own.
"""
from __future__ import annotations

import weakref


def adapt_accelerator(accelerator, engine) -> None:
    """For a training loop of your own: ``accelerator`` runs ``engine`` (an ``OffloadAdam`` or ``ShardedAdam``) as the
    Trainer integration runs it. Call it before ``accelerator.prepare``. Without it, Accelerate reported an engine's
    skipped fp16 overflow step as taken (``optimizer_step_was_skipped`` False, and a prepared LR scheduler advanced
    on it), copied the engine's whole state (fp32 masters and moments) to ``accelerator.device`` and back when
    preparing it, and wrapped the model in DDP on several processes (the engine reduces the gradients itself).
    ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` returns the engine's norm of this step's gradients
    and has the engine clip them at its step (Accelerate's found no ``.grad``, clipped nothing and returned 0.0).
    ``accelerator.backward(loss)`` then scales the loss by the engine's scale: do not call ``engine.scale_loss``
    too (another optimizer prepared beside the engine is therefore refused while the engine scales its loss).
    ``accelerator.free_memory()`` (or ``clear()``), Accelerate's reset between two trainings, undoes all of this: the
    Accelerator is a plain one again, which another engine may be adapted to."""
    from .engine.core import AdamCore  # (here: importing the engine loads the kernels, which the Trainer has done)

    if not isinstance(engine, AdamCore):
        raise TypeError(f"adapt_accelerator: engine must be an OffloadAdam or ShardedAdam, got {type(engine).__name__}"
                        " (CPUAdam and torch's optimizers need no adapting: pass them to accelerator.prepare as they are)")
    if getattr(accelerator, "_zo_patched", False):
        raise RuntimeError("adapt_accelerator: this Accelerator already runs an engine (adapted before, or a "
                           "ZeroOffload Trainer's): build a new Accelerator for another engine, or call "
                           "accelerator.free_memory() first")
    prepared = [what for what in ("optimizer", "model") if getattr(accelerator, f"_{what}s", None)]
    if prepared:  # (a model prepared on several processes is in DDP already, whose reduction the engine refuses)
        raise RuntimeError(f"adapt_accelerator: call it before accelerator.prepare; this Accelerator has prepared "
                           f"a{'n' if prepared[0] == 'optimizer' else ''} {prepared[0]} already, which keeps "
                           "Accelerate's device placement, skip flag or DDP wrapper")
    if getattr(accelerator, "scaler", None) is not None:  # (on a CPU Accelerate makes none)
        raise ValueError("adapt_accelerator: Accelerator(mixed_precision='fp16') scales the loss with torch's "
                         "GradScaler, which finds no gradient to unscale (the engine takes them during backward): "
                         "use the engine's own loss scaling (OffloadOptions(fp16=...), a model cast to fp16) with "
                         "mixed_precision='no', or bf16")
    patch_accelerator(accelerator, lambda: engine, others=_other_optimizer)
    kept = accelerator.__dict__.get("free_memory")
    acc = weakref.ref(accelerator)

    def free_memory_and_engine(*objects):
        # Accelerate's reset between two trainings (clear() calls it too). Patched on, the Accelerator scaled the
        # next loop's losses by the released engine's fp16 scale (a torch AdamW's gradients 65536x), kept that
        # engine alive, gave a new model no DDP wrapper and refused a new engine.
        a = acc()
        a._zo_unpatch()
        _restore(a, "free_memory", kept)
        return a.free_memory(*objects)

    accelerator.free_memory = free_memory_and_engine


def _other_optimizer(engine, optimizer, prepare_optimizer, device_placement):
    """An optimizer beside the adapted engine (a GAN's discriminator): Accelerate's own preparation, its own skip
    flag. With fp16 loss scaling it is refused: ``accelerator.backward`` scales every loss by the engine's scale,
    and that optimizer stepped the scaled gradients (65536x) without a word."""
    if engine.scaler.enabled:
        raise ValueError(
            f"adapt_accelerator: this Accelerator runs its engine ({type(engine).__name__}) with fp16 loss scaling, "
            "so accelerator.backward multiplies every loss by the engine's scale; another optimizer prepared on it "
            f"({type(optimizer).__name__}) would step gradients scaled by it: prepare that one on an Accelerator of "
            "its own, or leave this one unadapted and call engine.scale_loss(loss) yourself for the engine's loss")
    return prepare_optimizer(optimizer, device_placement=device_placement)


def _restore(accelerator, name: str, kept) -> None:
    """Put back ``accelerator.name`` as it was before a patch: ``kept``, or the class's method (None)."""
    if kept is None:
        accelerator.__dict__.pop(name, None)
    else:
        setattr(accelerator, name, kept)


def patch_accelerator(accelerator, engine_of, others=None) -> None:
    """``engine_of()``: the engine once it exists (None before ``create_optimizer``). Once per Accelerator (the
    Trainer's ``create_accelerator_and_postprocess`` and the end of its ``__init__`` both ask): a second wrap would
    scale the loss twice. ``others(engine, optimizer, prepare_optimizer, device_placement)``: how an optimizer
    other than the engine is prepared (None: as the engine is; the Trainer prepares its engine alone)."""
    if getattr(accelerator, "_zo_patched", False):
        return
    accelerator._zo_patched = True
    # Every function stored on the Accelerator holds it weakly and calls the method it replaces through it: a
    # closure over the Accelerator (or its bound methods) stored on the Accelerator made a reference cycle, and the
    # engine its prepared optimizer holds (host arena included) then lived on after ``del trainer`` until the
    # garbage collector ran (a plain Trainer is freed at once).
    kept = {name: accelerator.__dict__.get(name) for name in ("backward", "prepare_model", "prepare_optimizer",
                                                              "clip_grad_norm_", "clip_grad_value_")}
    acc = weakref.ref(accelerator)

    def original(name: str):
        a = acc()
        return kept[name] if kept[name] is not None else getattr(type(a), name).__get__(a)

    def unpatch():
        a = acc()
        for name, method in kept.items():
            _restore(a, name, method)
        del a._zo_patched, a._zo_unpatch

    accelerator._zo_unpatch = unpatch

    def scaled_backward(loss, **kw):
        engine = engine_of()
        return original("backward")(engine.scale_loss(loss) if engine is not None else loss, **kw)

    accelerator.backward = scaled_backward

    def prepare_without_ddp(model, device_placement=None, evaluation_mode=False):
        # No DDP wrapper: the engine reduces (or reduce-scatters) gradients itself, and a DDP
        # all-reduce on top would double the reduction. evaluation_mode skips only the wrapping.
        return original("prepare_model")(model, device_placement=device_placement, evaluation_mode=True)

    accelerator.prepare_model = prepare_without_ddp

    def prepare_in_place(optimizer, device_placement=None):
        engine = engine_of()
        if others is not None and engine is not None and optimizer is not engine:
            return others(engine, optimizer, original("prepare_optimizer"), device_placement)
        # Accelerate's device placement round-trips state_dict() through the accelerator's
        # device: a full copy of the fp32 masters and moments (12 B/param) on the GPU. Our
        # state stays where the engine put it.
        wrapped = original("prepare_optimizer")(optimizer, device_placement=False)
        wrapped._zo_engine_of = engine_of
        # a class, not a bound method stored on the instance (a cycle through the instance): optimizer.step stays a
        # bound method, as torch's LR schedulers expect (they wrap step.__func__)
        wrapped.__class__ = _reporting_skips(type(wrapped))
        return wrapped

    accelerator.prepare_optimizer = prepare_in_place

    def clip_grad_norm_by_engine(parameters, max_norm, norm_type=2):
        # Accelerate's calls torch's, which finds no .grad after the engine took them (OffloadAdam, ZeRO-2) and
        # returned 0.0 having clipped nothing (ZeRO-0/1: this rank's .grad before the average). The engine clips
        # at its step, by the coefficient its options' max_grad_norm applies (engine/clipping.py).
        engine, params = engine_of(), _listed(parameters)
        if engine is None or not engine.holds_any(params):  # another optimizer's params: Accelerate's clipping
            return original("clip_grad_norm_")(params, max_norm, norm_type=norm_type)
        if not acc().sync_gradients:
            raise RuntimeError(
                "accelerator.clip_grad_norm_ on a micro-batch that does not step (accelerator.sync_gradients is "
                "False): torch clips the partial sum in .grad and adds the next micro-batches unclipped, which the "
                f"engine ({type(engine).__name__}) cannot do; clip under `if accelerator.sync_gradients:`")
        return engine.clip_grad_norm_(max_norm, norm_type, parameters=params)

    accelerator.clip_grad_norm_ = clip_grad_norm_by_engine

    def clip_grad_value_by_engine(parameters, clip_value):
        engine, params = engine_of(), _listed(parameters)
        if engine is None or not engine.holds_any(params):
            return original("clip_grad_value_")(params, clip_value)
        # (torch's found no .grad and failed with "Expected !nested_tensorlist[0].empty()", or clipped this rank's
        # gradient before the average)
        raise ValueError(f"accelerator.clip_grad_value_ on the params of {type(engine).__name__}: the engine takes "
                         "each gradient during backward and clips by the global norm only (at its step); clip with "
                         "accelerator.clip_grad_norm_(model.parameters(), max_norm) instead")

    accelerator.clip_grad_value_ = clip_grad_value_by_engine


def _listed(parameters) -> list:
    """``parameters`` as torch's clipping takes them (one tensor, or an iterable, which may be a generator)."""
    return [parameters] if hasattr(parameters, "grad") else list(parameters)


_REPORTING: dict[type, type] = {}


def _reporting_skips(cls: type) -> type:
    """``cls`` (Accelerate's optimizer wrapper) whose ``step`` reports the engine's skipped steps, made once per class."""
    if getattr(cls, "_zo_reports_skips", False):
        return cls
    if cls not in _REPORTING:
        def step(self, *a, **kw):
            out = super(sub, self).step(*a, **kw)
            # An fp16 overflow step is skipped by the engine. Accelerate's step_was_skipped (read by
            # the Trainer before it steps the LR schedule) reports its own GradScaler's skips from
            # this flag; setting it leaves the scheduler unwrapped, so transformers still sees its
            # type (ReduceLROnPlateau / GreedyLR step on metrics, not here).
            engine = self._zo_engine_of()
            self._is_overflow = bool(engine is not None and engine.last.skipped)
            return out

        sub = type(cls.__name__, (cls,), {"step": step, "_zo_reports_skips": True, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _REPORTING[cls] = sub
    return _REPORTING[cls]
