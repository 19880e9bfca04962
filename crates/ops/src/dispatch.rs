//! Dispatch by float dtype, shared by our kernels' launches and their CPU twins.

/// `by_float!(dtype, "op", |T, SUFFIX| body)`: `body` with `T` the element type of a
/// float `dtype` (f32, bf16 or f16) and `SUFFIX` its kernel-name suffix (`"bf16"`…);
/// any other dtype is an error naming the op.
#[cfg(feature = "cuda")]
macro_rules! by_float {
    ($dtype:expr, $what:literal, |$t:ident, $suffix:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                const $suffix: &str = "f32";
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                const $suffix: &str = "bf16";
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                const $suffix: &str = "f16";
                $body
            }
            other => candle_core::bail!("{}: unsupported dtype {other:?}", $what),
        }
    };
}

/// `cpu_float!("op", (a, b, …) => body)`: with `a`, `b`, … CPU storages of one float
/// dtype, rebinds each to its slice and wraps `body` (a `Vec` of that dtype) back into a
/// storage; mixed or other dtypes are an error naming the op.
macro_rules! cpu_float {
    ($what:literal, ($($s:ident),+) => $body:expr) => {
        match ($($s,)+) {
            ($(candle_core::CpuStorage::F32($s),)+) => candle_core::CpuStorage::F32($body),
            ($(candle_core::CpuStorage::BF16($s),)+) => candle_core::CpuStorage::BF16($body),
            ($(candle_core::CpuStorage::F16($s),)+) => candle_core::CpuStorage::F16($body),
            _ => candle_core::bail!("{}: the inputs must share one float dtype (f32, bf16 or f16)", $what),
        }
    };
}

#[cfg(feature = "cuda")]
pub(crate) use by_float;
pub(crate) use cpu_float;
