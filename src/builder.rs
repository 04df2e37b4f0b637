//! [`AllocatorBuilder`]: configuration and backend choice.
//!
//! The backend is the simulated GPU by default when no GPU is present (logged at `info`, so
//! nobody mistakes it for a GPU). Asking for CUDA explicitly on a machine without one, or in a
//! build without the `cuda` backend, is an error (`BackendError::Unavailable`), never a silent
//! fallback to the sim. The environment variable `GPUALLOC_BACKEND` (`cuda`, `sim` or
//! `auto`) chooses for [`BackendKind::Auto`], so a test suite or a benchmark runs on a GPU
//! unchanged (`GPUALLOC_BACKEND=cuda`).

use std::sync::Arc;
use std::time::Duration;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_host::{HostConfig, HostCore, HostError, MonotonicClock};
use gpualloc_runtime::{Backend, BackendError, CaptureSafe, DeviceId};
use gpualloc_sim::{SimBackend, SimConfig};

use crate::actor::{spawn_actor_task, DeviceActor};
use crate::allocator::Allocator;
use crate::error::Error;
use crate::fork::ProcessGuard;
use crate::oom::{OomEvent, OomObservers};
use crate::pinned::HostActor;

/// Which GPU runtime the allocator runs on.
#[derive(Clone, Default)]
pub enum BackendKind {
    /// What `GPUALLOC_BACKEND` says (`cuda`: CUDA or an error, `sim`: the simulated GPU);
    /// unset or `auto`: CUDA if a GPU is present, else the simulated GPU (logged).
    #[default]
    Auto,
    /// The simulated GPU (real memory, worker-thread streams), default configuration:
    /// one 16 GiB device with real-hardware latencies.
    Sim,
    /// The simulated GPU with this configuration.
    SimWith(Box<SimConfig>),
    /// CUDA; an error if unavailable.
    Cuda,
    /// Addresses and byte counts only (no memory behind them): `devices` devices of
    /// `capacity` bytes. For replays and benchmarks of the allocator itself.
    Accounting {
        /// Number of devices.
        devices: u32,
        /// Bytes per device.
        capacity: u64,
    },
    /// A backend the caller built.
    Custom(Arc<dyn Backend>),
}

/// The environment variable that chooses the backend for [`BackendKind::Auto`].
pub const BACKEND_ENV: &str = "GPUALLOC_BACKEND";

impl BackendKind {
    /// The backend `GPUALLOC_BACKEND` names: `cuda` → [`BackendKind::Cuda`], `sim` →
    /// [`BackendKind::Sim`], unset, empty or `auto` → [`BackendKind::Auto`] (case-insensitive);
    /// anything else is an `InvalidValue` error.
    pub fn from_env() -> Result<BackendKind, Error> {
        let value = std::env::var(BACKEND_ENV).unwrap_or_default();
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendKind::Auto),
            "cuda" => Ok(BackendKind::Cuda),
            "sim" => Ok(BackendKind::Sim),
            other => Err(BackendError::invalid(format!(
                "{BACKEND_ENV}={other}: expected cuda, sim or auto"
            ))
            .into()),
        }
    }
}

impl std::fmt::Debug for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendKind::Auto => f.write_str("Auto"),
            BackendKind::Sim => f.write_str("Sim"),
            BackendKind::SimWith(c) => write!(f, "SimWith({c:?})"),
            BackendKind::Cuda => f.write_str("Cuda"),
            BackendKind::Accounting { devices, capacity } => {
                write!(
                    f,
                    "Accounting {{ devices: {devices}, capacity: {capacity} }}"
                )
            }
            BackendKind::Custom(b) => write!(f, "Custom({})", b.name()),
        }
    }
}

/// Builds an [`Allocator`].
#[derive(Debug, Clone)]
pub struct AllocatorBuilder {
    config: Option<AllocatorConfig>,
    config_str: Option<String>,
    backend: BackendKind,
    reaper_interval: Duration,
    oom: OomObservers,
}

impl Default for AllocatorBuilder {
    fn default() -> Self {
        AllocatorBuilder {
            config: None,
            config_str: None,
            backend: BackendKind::Auto,
            reaper_interval: Duration::from_millis(1),
            oom: OomObservers::default(),
        }
    }
}

impl AllocatorBuilder {
    /// Defaults: `GPUALLOC_CONF` (or `PYTORCH_CUDA_ALLOC_CONF`) if set, automatic backend.
    pub fn new() -> Self {
        AllocatorBuilder::default()
    }

    /// Uses this configuration (instead of the environment's).
    pub fn config(mut self, config: AllocatorConfig) -> Self {
        self.config = Some(config);
        self.config_str = None;
        self
    }

    /// Parses a configuration string in PyTorch's syntax, e.g.
    /// `"max_split_size_mb:128,garbage_collection_threshold:0.8"` (errors at `build`).
    pub fn config_str(mut self, config: impl Into<String>) -> Self {
        self.config_str = Some(config.into());
        self.config = None;
        self
    }

    /// Chooses the backend.
    pub fn backend(mut self, backend: BackendKind) -> Self {
        self.backend = backend;
        self
    }

    /// Runs on a backend the caller built.
    pub fn backend_instance(self, backend: Arc<dyn Backend>) -> Self {
        self.backend(BackendKind::Custom(backend))
    }

    /// How often the reaper completes finished cross-stream frees while any are pending
    /// (default 1 ms; it sleeps when none are).
    pub fn reaper_interval(mut self, interval: Duration) -> Self {
        self.reaper_interval = interval.max(Duration::from_micros(10));
        self
    }

    fn resolve_config(&self) -> Result<AllocatorConfig, Error> {
        if let Some(s) = &self.config_str {
            return Ok(AllocatorConfig::parse(s)?);
        }
        let config = match &self.config {
            Some(c) => c.clone(),
            None => AllocatorConfig::from_env()?,
        };
        // Public fields set directly are held to the parser's rules.
        config.validate()?;
        Ok(config)
    }

    fn resolve_backend(&self) -> Result<Arc<dyn Backend>, Error> {
        match &self.backend {
            BackendKind::Custom(b) => Ok(b.clone()),
            BackendKind::Accounting { devices, capacity } => {
                if *devices == 0 {
                    return Err(BackendError::invalid(
                        "the accounting backend needs at least one device",
                    )
                    .into());
                }
                Ok(Arc::new(AccountingBackend::new(*devices, *capacity)))
            }
            BackendKind::Cuda => cuda_backend(),
            BackendKind::Sim => sim_backend(),
            BackendKind::SimWith(c) => Ok(SimBackend::new(**c)?),
            BackendKind::Auto => match BackendKind::from_env()? {
                BackendKind::Cuda => cuda_backend(),
                BackendKind::Sim => sim_backend(),
                _ => match cuda_backend() {
                    Ok(b) => Ok(b),
                    Err(e) => {
                        tracing::info!(reason = %e, "no GPU found: using the simulated GPU (sim backend)");
                        sim_backend()
                    }
                },
            },
        }
    }

    /// Calls `observer` whenever a `malloc` fails with an out-of-memory error (see
    /// [`OomEvent`] and `oom.rs`: after the failure, off the device's gate, before the
    /// `malloc` returns). May be called more than once; observers run in that order.
    pub fn on_oom(mut self, observer: impl Fn(&OomEvent) + Send + Sync + 'static) -> Self {
        self.oom.0.push(Arc::new(observer));
        self
    }

    /// Builds the allocator: one device actor per device of the backend, each with its task
    /// on the current tokio runtime (so call this from inside one).
    pub fn build(self) -> Result<Allocator, Error> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::NoRuntime)?;
        let backend = self.resolve_backend()?;
        let count = backend.device_count()?;
        // The `gpualloc` policy's default: expandable segments where every device has
        // virtual memory, unless the config names them (`AllocatorConfig::resolved`).
        let vmm = (0..count).all(|d| backend.has_vmm(DeviceId(d)));
        let config = self.resolve_config()?.resolved(vmm);
        let process = ProcessGuard::current();
        // The allocators' own driver calls never invalidate a user's stream capture: they
        // run in relaxed capture mode (`gpualloc_runtime::capture_safe`), as PyTorch's
        // `cudaMalloc` does.
        let own: Arc<dyn Backend> = Arc::new(CaptureSafe::new(backend.clone()));
        let mut devices = Vec::with_capacity(count as usize);
        let mut tasks = Vec::with_capacity(count as usize);
        for d in 0..count {
            let core = DeviceCore::new(own.clone(), DeviceId(d), config.clone())?;
            let actor = DeviceActor::new(core, backend.clone(), process, runtime.clone());
            tasks.push(spawn_actor_task(
                actor.clone(),
                &runtime,
                self.reaper_interval,
            ));
            devices.push(actor);
        }
        let host = HostActor::new(
            HostCore::new(
                own.clone(),
                host_config(&config)?,
                Arc::new(MonotonicClock::new()),
            )?,
            backend.clone(),
            process,
        );
        tasks.push(spawn_actor_task(
            host.clone(),
            &runtime,
            self.reaper_interval,
        ));
        tracing::info!(
            backend = backend.name(),
            devices = count,
            "gpualloc allocator ready"
        );
        Ok(Allocator::from_parts(
            backend, devices, host, process, tasks, config, self.oom,
        ))
    }
}

/// The pinned-host allocator's settings: the `pinned_*` entries of the config string, applied
/// in order ([`HostConfig::apply`]); a bad key or value is a typed error at build time.
fn host_config(config: &AllocatorConfig) -> Result<HostConfig, Error> {
    let mut host = HostConfig::default();
    for (key, value) in &config.pinned {
        host.apply(key, value).map_err(HostError::from)?;
    }
    Ok(host)
}

/// The CUDA backend: `Unavailable` (typed, never a silent fallback) in a build without the
/// `cuda` feature, or when the driver or a device is missing.
pub fn cuda_backend() -> Result<Arc<dyn Backend>, Error> {
    #[cfg(feature = "cuda")]
    {
        Ok(gpualloc_cuda::CudaBackend::new()?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(
            BackendError::Unavailable("this build has no cuda backend (feature `cuda`)".into())
                .into(),
        )
    }
}

/// The simulated GPU with its default configuration (one 16 GiB device, real-hardware
/// latencies).
pub fn sim_backend() -> Result<Arc<dyn Backend>, Error> {
    Ok(SimBackend::new(SimConfig::default())?)
}
