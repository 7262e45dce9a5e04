//! Fallible allocation of the arrays a constructor sizes by a caller's number (F1, R29).
//!
//! Counts are capped by the constructors first ([`crate::MAX_BLOCKS`]); this module catches
//! what the caps still allow but the machine lacks, as an [`KvPoolError::InvalidArgument`]
//! naming the argument that asked for it, never an abort in the allocator:
//! - [`probe`] asks for a constructor's whole footprint in one request before any array is
//!   filled (the kernel's overcommit heuristic judges single requests, so arrays that each fit
//!   but together do not would otherwise be filled until the OOM killer ends the process);
//! - every per-id array is then reserved with `try_reserve_exact` before anything is written.

use crate::error::{KvPoolError, Result};

/// Asks the allocator for `bytes` at once and gives them straight back, untouched (so nothing is
/// committed): an error naming `name` if the machine cannot hold them.
pub(crate) fn probe(bytes: u128, name: &'static str) -> Result<()> {
    let too_large = || {
        KvPoolError::invalid(
            name,
            format!(
                "needs {:.1} GiB that cannot be allocated on this machine",
                bytes as f64 / (1u64 << 30) as f64
            ),
        )
    };
    let bytes = usize::try_from(bytes).map_err(|_| too_large())?;
    let mut memory: Vec<u8> = Vec::new();
    memory.try_reserve_exact(bytes).map_err(|_| too_large())?;
    Ok(())
}

/// A vector of `n` values made by `make`, or an error naming `name` if `n` of them cannot be
/// allocated.
pub(crate) fn filled<T>(n: usize, name: &'static str, make: impl FnMut() -> T) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| cannot_allocate(name, n, std::mem::size_of::<T>()))?;
    out.extend(std::iter::repeat_with(make).take(n));
    Ok(out)
}

/// [`filled`] as a boxed slice.
pub(crate) fn boxed<T>(n: usize, name: &'static str, make: impl FnMut() -> T) -> Result<Box<[T]>> {
    filled(n, name, make).map(Vec::into_boxed_slice)
}

fn cannot_allocate(name: &'static str, n: usize, size: usize) -> KvPoolError {
    let bytes = (n as u128) * (size as u128);
    KvPoolError::invalid(
        name,
        format!(
            "needs {n} entries ({:.1} GiB) that cannot be allocated on this machine",
            bytes as f64 / (1u64 << 30) as f64
        ),
    )
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_footprint_is_an_error_naming_the_argument() {
        let error = probe(u128::MAX, "num_blocks").unwrap_err();
        assert!(matches!(
            error,
            KvPoolError::InvalidArgument {
                name: "num_blocks",
                ..
            }
        ));
        probe(1 << 20, "num_blocks").unwrap();
    }

    #[test]
    fn an_impossible_size_is_an_error_naming_the_argument() {
        let error = filled(usize::MAX / 8, "num_blocks", || 0u64).unwrap_err();
        assert!(matches!(
            error,
            KvPoolError::InvalidArgument {
                name: "num_blocks",
                ..
            }
        ));
        assert_eq!(filled(3, "n", || 7u8).unwrap(), vec![7, 7, 7]);
    }
}
