//! The one error type of the core.
//!
//! Every fallible public entry returns [`Result<T>`]; no public path panics on bad input. The
//! bindings map [`KvPoolError::InvalidArgument`] to `ValueError`, [`KvPoolError::OutOfBlocks`] to
//! `kvpool.OutOfBlocksError`, [`KvPoolError::Invariant`] to `kvpool.InvariantError` and
//! [`KvPoolError::PageBackend`] to `kvpool.KVPoolError` (or the backend's own exception) (R29).

/// Errors of the kvpool core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvPoolError {
    /// A manager cannot hand out what was asked for: `requested` blocks with `available` free or
    /// evictable (R3). Nothing was changed.
    #[error("out of blocks: requested {requested}, available {available}")]
    OutOfBlocks {
        /// Blocks asked for.
        requested: usize,
        /// Free plus evictable blocks there were.
        available: usize,
    },
    /// An argument is out of its domain; `name` is the argument's name. Nothing was changed.
    #[error("{name}: {message}")]
    InvalidArgument {
        /// The argument's name (as the caller spells it).
        name: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A structure broke one of the contract's rules (found by `check()`).
    #[error("invariant violated: {0}")]
    Invariant(String),
    /// The memory behind a page could not be mapped or unmapped for a reason other than a lack
    /// of memory (which is [`KvPoolError::OutOfBlocks`]): see [`crate::xtensor::PageError`].
    /// The manager's structures are consistent (the page keeps the state the backend left).
    #[error("page backend: {0}")]
    PageBackend(String),
}

/// `Result` with [`KvPoolError`].
pub type Result<T> = std::result::Result<T, KvPoolError>;

impl KvPoolError {
    /// Builds an [`KvPoolError::InvalidArgument`].
    pub fn invalid(name: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            name,
            message: message.into(),
        }
    }
}

impl KvPoolError {
    /// An `InvalidArgument` about `from` as one about `to` (a part validated under its own name
    /// for a caller that takes it under another); other errors unchanged.
    pub(crate) fn renamed(self, from: &str, to: &'static str) -> Self {
        match self {
            Self::InvalidArgument { name, message } if name == from => Self::invalid(to, message),
            other => other,
        }
    }

    /// Every `InvalidArgument` as one about `to`; other errors unchanged.
    pub(crate) fn renamed_all(self, to: &'static str) -> Self {
        match self {
            Self::InvalidArgument { message, .. } => Self::invalid(to, message),
            other => other,
        }
    }

    /// An `Invariant` prefixed with the dp rank (and `what` of it) it was found in.
    pub(crate) fn in_rank(self, rank: usize, what: &str) -> Self {
        match self {
            Self::Invariant(message) if what.is_empty() => {
                Self::Invariant(format!("dp rank {rank}: {message}"))
            }
            Self::Invariant(message) => {
                Self::Invariant(format!("dp rank {rank} {what}: {message}"))
            }
            other => other,
        }
    }
}

/// Returns `Err(InvalidArgument)` from the enclosing function unless `cond` holds.
macro_rules! ensure_arg {
    ($cond:expr, $name:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::KvPoolError::invalid($name, format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure_arg;

/// Returns `Err(Invariant)` from the enclosing function unless `cond` holds.
macro_rules! ensure_invariant {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::KvPoolError::Invariant(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure_invariant;
