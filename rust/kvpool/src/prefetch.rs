//! Cache-line prefetch hints, for walks whose next addresses are known before their data is
//! needed (a chain's index look-ups, its entries' lines): asking for several lines at once
//! lets their misses overlap instead of queueing one behind the other.
//!
//! A hint changes no value the program reads, so it keeps no invariant of its own; on targets
//! without a prefetch instruction it does nothing.

/// Asks the cache for the line holding `value` (the caller reads it soon).
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    let at = value as *const T;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults and reads nothing the program sees, at
    // any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}
