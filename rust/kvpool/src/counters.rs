//! One field list per statistics struct: [`counters!`] declares the struct and generates from
//! the same list its `visit` (every counter with its key, in order: what the bindings build their
//! dicts from, and what tests compare with the stubs), its `KEYS` and its summing `add`.
//!
//! Counters come in sections (the dict they belong to: `rank`, `window`, `host`, `remote`); the
//! block counts of the struct's manager are its `counts` field, visited by the caller.

/// Declares a statistics struct with `counts: BlockCounts` and sections of counters.
macro_rules! counters {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( + $(#[$extra_meta:meta])* $extra:ident : $extra_ty:ty; )*
            $(
                $section:ident {
                    $( $(#[$field_meta:meta])* $field:ident : $ty:ty => $key:literal ),* $(,)?
                }
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq)]
        pub struct $name {
            /// Block counts (R2).
            pub counts: $crate::manager::BlockCounts,
            $( $( $(#[$field_meta])* pub $field: $ty, )* )*
            $( $(#[$extra_meta])* pub $extra: $extra_ty, )*
        }

        impl $name {
            /// `(section, key)` of every counter, in the order of [`Self::visit`].
            pub const KEYS: &'static [(&'static str, &'static str)] =
                &[$( $( (stringify!($section), $key), )* )*];

            /// Calls `f(section, key, value)` for every counter, in declaration order (`counts`
            /// and the extra fields are the caller's).
            pub fn visit(&self, mut f: impl FnMut(&'static str, &'static str, u64)) {
                $( $( f(stringify!($section), $key, self.$field as u64); )* )*
            }

            /// Adds `other`'s counts and counters (not the extra fields).
            pub(crate) fn add_counters(&mut self, other: &Self) {
                self.counts.add(&other.counts);
                $( $( self.$field += other.$field; )* )*
            }
        }
    };
}
pub(crate) use counters;
