//! Runtime dispatch to wider vector units: a function whose body the compiler vectorises is
//! compiled once per tier (AVX-512F, AVX2) and for the baseline target, and the widest tier
//! the CPU has is taken. The same arithmetic at every tier (integer kernels; float kernels
//! with plain `+ − ×`, no fused multiply-add), so results never depend on the CPU.

/// One tier of a dispatch: `$kernel` compiled with `$feature`, returned from where the CPU
/// has it. Used inside [`dispatch!`] and [`dispatch_wide!`] only.
macro_rules! tier {
    ($feature:tt, $tier:ident, $kernel:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        #[target_feature(enable = $feature)]
        fn $tier($($arg: $ty),*) -> $ret {
            $kernel($($arg),*)
        }
        if std::is_x86_feature_detected!($feature) {
            // SAFETY: the CPU supports the tier's feature, checked just above.
            return unsafe { $tier($($arg),*) };
        }
    };
}
pub(crate) use tier;

/// `dispatch!(name(arg: Ty, …) -> Ret => kernel)` defines `name`, which calls the
/// `#[inline(always)]` function `kernel` compiled for AVX2 where the CPU has it.
macro_rules! dispatch {
    ($(#[$attr:meta])* $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $kernel:ident) => {
        $(#[$attr])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                $crate::simd::tier!("avx2", avx2, $kernel, ($($arg: $ty),*) -> $ret);
            }
            $kernel($($arg),*)
        }
    };
}
pub(crate) use dispatch;

/// As [`dispatch!`], with an AVX-512F tier before AVX2: for float kernels whose lanes are
/// independent, where the wider registers pay.
macro_rules! dispatch_wide {
    ($(#[$attr:meta])* $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $kernel:ident) => {
        $(#[$attr])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                $crate::simd::tier!("avx512f", avx512, $kernel, ($($arg: $ty),*) -> $ret);
                $crate::simd::tier!("avx2", avx2, $kernel, ($($arg: $ty),*) -> $ret);
            }
            $kernel($($arg),*)
        }
    };
}
pub(crate) use dispatch_wide;
