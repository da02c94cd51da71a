"""The operator's recalibration loop: what the engine pods' own metrics teach of each hardware's step model.

Each autoscaling round scrapes the Ready engine pods; the same readings feed an online estimator per
:class:`~hetsched.perf.online.CorrectionKey` (the model on one accelerator or slice at one TP), a window between
two readings of a pod at a time (:class:`~hetsched.router.learning.WindowLearner`). When a key's trusted
correction moves more than ``threshold`` from the one in force (in any scale, relatively), it is reported as a
:class:`CorrectionMoved`: the shell stores it, records an Event and a condition on the ModelDeployments it
concerns, and plans again with it (the churn penalty keeps the plan from moving for less than it saves).

Pure: readings and times come in, decisions go out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetsched.autoscale.fleet import Fleet
from hetsched.autoscale.signals import PodSample
from hetsched.errors import HetschedError
from hetsched.optimizer.spec import ClusterSpec, ModelSpec
from hetsched.perf.correction import IDENTITY, StepCorrection
from hetsched.perf.online import CorrectionKey, Estimate, OnlineEstimator
from hetsched.router.learning import WINDOW_SETTINGS, WindowLearner
from hetsched.router.predict import EndpointProfile
from hetsched.specs.hf import parse_hf_config
from hetsched.specs.model import ModelArch
from hetsched.specs.registry import load_model
from hetsched.specs.wire import OptionKey

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.1
"""A correction moves the plan when a scale moves by more than this share."""


@dataclass(frozen=True)
class CorrectionMoved:
    """A key's trusted correction moved past the threshold: from ``before`` to the estimate's."""

    key: CorrectionKey
    before: StepCorrection
    estimate: Estimate
    models: tuple[str, ...]
    """The cluster's models (ModelDeployment names) served on the key's hardware."""

    @property
    def message(self) -> str:
        after = self.estimate.correction
        return (f"the step model of {self.key.label} is corrected from prefill x{self.before.prefill_scale:.3g}, "
                f"decode x{self.before.decode_scale:.3g} to prefill x{after.prefill_scale:.3g}, decode "
                f"x{after.decode_scale:.3g} ({self.estimate.observations} observations of "
                f"{self.estimate.sources} pod(s)); re-planning with it")


def model_arch(model: ModelSpec) -> ModelArch | None:
    """The architecture a model's step model times (an inline config, else the bundled or local one); None when
    it cannot be read (the model is then not learned from; planning says what is wrong with it)."""
    try:
        if model.config is not None:
            return parse_hf_config(model.config, name=model.source)
        return load_model(model.source)
    except HetschedError:
        return None


def correction_keys(spec: ClusterSpec, fleet: Fleet, backends: Mapping[str, str]) -> dict[
        OptionKey, tuple[CorrectionKey, ModelArch]]:
    """What each of the fleet's replica options teaches, with the architecture its step model times;
    ``backends``: the attention backend each model's engines run with, where its ModelDeployment names one."""
    archs = {m.name: arch for m in spec.models if (arch := model_arch(m)) is not None}
    return {o.key: (CorrectionKey(archs[o.key.model].name, o.key.device, o.key.tp,
                                  attention_backend=backends.get(o.key.model, "")), archs[o.key.model])
            for o in fleet.options if o.key.model in archs}


def moved(before: StepCorrection, after: StepCorrection, threshold: float) -> bool:
    return (abs(after.prefill_scale / before.prefill_scale - 1) > threshold
            or abs(after.decode_scale / before.decode_scale - 1) > threshold)


class FleetCalibration:
    """Corrections per key from the pods' scrapes, and which moved enough to plan again.

    ``keys`` maps the fleet's replica options to what they teach; ``profile`` gives the step model a key is
    predicted with (None: the key cannot be predicted, so it is not learned); ``in_force`` holds the corrections
    already used (stored ones), which the estimates start from.
    """

    def __init__(self, *, profile: Callable[[CorrectionKey], EndpointProfile | None],
                 in_force: Mapping[CorrectionKey, StepCorrection] | None = None,
                 threshold: float = DEFAULT_THRESHOLD) -> None:
        self.profile = profile
        self.threshold = threshold
        self.in_force = dict(in_force or {})
        self.estimator = OnlineEstimator(WINDOW_SETTINGS, priors=self.in_force)
        self.learner = WindowLearner(self.estimator)
        self._warned: dict[str, str] = {}

    def observe(self, samples: Sequence[PodSample], keys: Mapping[OptionKey, CorrectionKey], *,
                now: float) -> list[CorrectionMoved]:
        """Learn from one round's scrapes; the keys whose correction moved past the threshold, now in force."""
        seen: dict[CorrectionKey, set[str]] = {}
        for sample in samples:
            key = keys.get(sample.key)
            if key is None or not sample.ready:
                continue
            profile = self.profile(key)
            if profile is None:
                continue
            seen.setdefault(key, set()).add(sample.key.model)
            reason = self.learner.scraped(key, profile, sample.pod, sample.metrics, at=now)
            if reason and self._warned.get(sample.pod) != reason:
                log.warning("pod %s teaches nothing of %s: %s", sample.pod, key.label, reason)
            if reason:
                self._warned[sample.pod] = reason
        found = []
        for key, models in sorted(seen.items()):
            estimate = self.estimator.estimate(key, at=now)
            for outlier in estimate.outliers:
                if self._warned.get(outlier.source) != "outlier":
                    self._warned[outlier.source] = "outlier"
                    log.warning("pod %s runs %.2fx its siblings' times on %s: kept out of its correction",
                                outlier.source, outlier.ratio, key.label)
            before = self.in_force.get(key, IDENTITY)
            if estimate.trusted and moved(before, estimate.correction, self.threshold):
                self.in_force[key] = estimate.correction
                found.append(CorrectionMoved(key, before, estimate, tuple(sorted(models))))
        return found

    def forget(self, pods: Sequence[str]) -> None:
        """Pods that went away."""
        for pod in pods:
            self.learner.forget(pod)
            self._warned.pop(pod, None)
