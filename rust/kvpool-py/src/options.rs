//! The keyword options of the pool constructors, read by one extractor shared by
//! `BlockManagerPool(num_blocks, block_size, **options)` and
//! `HierarchyBlockManagerPool(num_blocks, host_num_blocks, block_size, **options)`: each option
//! validated under its own name (R29), an unknown one a `TypeError`, None the default, but for
//! the flags (`enable_prefix_cache`, `concurrent`, `enable_events`, `dedup`), which must be
//! bools when given (R29, "One rule for bools").

use kvpool::{Eviction, LinearStateMatch, LinearStateSave, PoolConfig};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::convert;
use crate::errors::IntoPyResult;

/// The options every pool takes.
pub(crate) const POOL_OPTIONS: &[&str] = &[
    "dp_size",
    "enable_prefix_cache",
    "num_single_blocks",
    "linear_state_slots",
    "checkpoint_interval",
    "linear_state_match",
    "linear_state_save",
    "linear_state_blocks",
    "block_bytes",
    "concurrent",
    "enable_events",
    "event_replay",
    "hash_seed",
    "sliding_window",
    "attention_chunk_size",
    "window_groups",
    "state_groups",
    "swa_num_blocks",
    "shared_blocks",
    "retention_tokens",
    "debug_hash_bits",
    "dedup",
    "eviction",
    "protected_percent",
    "max_retained_fraction",
];

/// The `**options` of a constructor, checked against the names it takes.
pub(crate) struct Options<'py> {
    given: Option<Bound<'py, PyDict>>,
}

impl<'py> Options<'py> {
    /// `options` (the constructor `cls` takes `POOL_OPTIONS` plus `extra`); an unknown name is a
    /// `TypeError` as Python's own.
    pub(crate) fn new(
        cls: &str,
        options: Option<&Bound<'py, PyDict>>,
        extra: &[&str],
    ) -> PyResult<Self> {
        if let Some(options) = options {
            for key in options.keys() {
                let key = key.cast_into::<PyString>()?;
                let key = key.to_str()?;
                if !POOL_OPTIONS.contains(&key) && !extra.contains(&key) {
                    return Err(PyTypeError::new_err(format!(
                        "{cls}() got an unexpected keyword argument '{key}'"
                    )));
                }
            }
        }
        Ok(Self {
            given: options.cloned(),
        })
    }

    /// The value of `name`, if given and not None.
    pub(crate) fn get(&self, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        match &self.given {
            Some(d) => Ok(d.get_item(name)?.filter(|v| !v.is_none())),
            None => Ok(None),
        }
    }

    /// A flag (F10: a bool or nothing; a None given is a `TypeError` naming it).
    pub(crate) fn flag(&self, name: &str, default: bool) -> PyResult<bool> {
        let given = match &self.given {
            Some(d) => d.get_item(name)?,
            None => None,
        };
        convert::flag(given.as_ref(), name, default)
    }

    /// A count, or `None`.
    pub(crate) fn count(&self, name: &str) -> PyResult<Option<usize>> {
        convert::optional_count(self.get(name)?.as_ref(), name)
    }

    /// A str option.
    pub(crate) fn choice(&self, name: &str, default: &str) -> PyResult<String> {
        convert::choice(self.get(name)?.as_ref(), name, default)
    }

    /// The pool options, with `concurrent`.
    pub(crate) fn pool_config(
        &self,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
    ) -> PyResult<(PoolConfig, bool)> {
        let enable_prefix_cache = self.flag("enable_prefix_cache", true)?;
        let concurrent = self.flag("concurrent", false)?;
        let enable_events = self.flag("enable_events", false)?;
        let num_blocks = convert::count(num_blocks, "num_blocks")?;
        let block_size = convert::count(block_size, "block_size")?;
        let dp_size = self.count("dp_size")?.unwrap_or(1);
        let num_single_blocks = self.count("num_single_blocks")?;
        let linear_state_match =
            LinearStateMatch::parse(&self.choice("linear_state_match", "deepest")?).py()?;
        let linear_state_save =
            LinearStateSave::parse(&self.choice("linear_state_save", "copy")?).py()?;
        let eviction = Eviction::parse(&self.choice("eviction", "lru")?).py()?;
        let hasher = convert::hasher(
            self.get("hash_seed")?.as_ref(),
            self.get("debug_hash_bits")?.as_ref(),
        )?;
        let config = PoolConfig {
            num_blocks,
            block_size,
            dp_size,
            enable_prefix_cache,
            num_single_blocks,
            hasher,
            enable_events,
            event_replay: self
                .count("event_replay")?
                .unwrap_or(kvpool::DEFAULT_EVENT_REPLAY),
            linear_state_slots: self.count("linear_state_slots")?.unwrap_or(0),
            checkpoint_interval: self.count("checkpoint_interval")?,
            linear_state_match,
            linear_state_save,
            linear_state_blocks: self.count("linear_state_blocks")?.unwrap_or(0),
            block_bytes: self.count("block_bytes")?.unwrap_or(0) as u64,
            sliding_window: self.count("sliding_window")?,
            attention_chunk_size: self.count("attention_chunk_size")?,
            window_groups: self.count("window_groups")?.unwrap_or(1),
            state_groups: self.count("state_groups")?.unwrap_or(0),
            swa_num_blocks: self.count("swa_num_blocks")?,
            // None: the default (shared unless the window group is sized on its own)
            shared_blocks: match self.get("shared_blocks")? {
                None => None,
                Some(value) => Some(convert::flag(Some(&value), "shared_blocks", false)?),
            },
            retention_tokens: self
                .count("retention_tokens")?
                .unwrap_or(kvpool::DEFAULT_RETENTION_TOKENS),
            host: None,
            xtensor: crate::elastic::xtensor_option(self.get("xtensor")?.as_ref())?,
            dedup: self.flag("dedup", true)?,
            eviction,
            protected_percent: self
                .count("protected_percent")?
                .unwrap_or(kvpool::DEFAULT_PROTECTED_PERCENT),
            max_retained_fraction: match self.get("max_retained_fraction")? {
                None => 0.5,
                Some(value) => convert::seconds(&value, "max_retained_fraction")?,
            },
        };
        Ok((config, concurrent))
    }
}
