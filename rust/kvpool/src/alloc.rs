//! Fallible allocation of the arrays a constructor sizes by a caller's number (F1, R29).
//!
//! Every per-id array of a manager, cache or slot pool is made here: the memory is reserved
//! with `try_reserve_exact` before anything is written, so a size the machine cannot hold is an
//! [`KvPoolError::InvalidArgument`] naming the argument that asked for it, never an abort in
//! the allocator. Counts are capped by the constructors first ([`crate::MAX_BLOCKS`]); this
//! catches what the caps still allow but the machine lacks.

use crate::error::{KvPoolError, Result};

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
