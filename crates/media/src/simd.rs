//! Runtime dispatch to AVX2: a function whose body the compiler vectorises is compiled twice,
//! once for AVX2 (taken where the CPU has it) and once for the baseline target. The same
//! integer arithmetic either way, so results never depend on the CPU.

/// `dispatch!(name(arg: Ty, …) -> Ret => kernel)` defines `name`, which calls the
/// `#[inline(always)]` function `kernel` compiled for AVX2 where the CPU has it.
macro_rules! dispatch {
    ($(#[$attr:meta])* $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $kernel:ident) => {
        $(#[$attr])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $kernel($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $kernel($($arg),*)
        }
    };
}
pub(crate) use dispatch;

/// As [`dispatch!`], with an AVX-512F tier before AVX2: for float kernels whose lanes are
/// independent and whose arithmetic is plain `+ − ×` (no fused multiply-add), so that every
/// width gives the same bits.
macro_rules! dispatch_wide {
    ($(#[$attr:meta])* $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $kernel:ident) => {
        $(#[$attr])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $kernel($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $kernel($($arg),*)
                }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports AVX-512F, checked just above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $kernel($($arg),*)
        }
    };
}
pub(crate) use dispatch_wide;
