//! Typed access to a JSON object with transformers' defaults for missing fields.

use serde_json::Value;

/// A view of one config object (top level, `text_config` or `vision_config`).
pub(crate) struct Fields<'a> {
    pub(crate) obj: &'a Value,
    pub(crate) name: &'static str,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(obj: &'a Value, name: &'static str) -> Self {
        Fields { obj, name }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn usize_or(&self, key: &str, default: usize) -> Result<usize, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("{}.{key} must be a non-negative integer, got {v}", self.name)),
        }
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, String> {
        self.get(key).map(|_| self.usize_or(key, 0)).transpose()
    }

    pub(crate) fn f64_or(&self, key: &str, default: f64) -> Result<f64, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| format!("{}.{key} must be a number, got {v}", self.name)),
        }
    }

    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| format!("{}.{key} must be a boolean, got {v}", self.name)),
        }
    }

    pub(crate) fn str_or(&self, key: &str, default: &str) -> Result<String, String> {
        match self.get(key) {
            None => Ok(default.to_string()),
            Some(v) => {
                v.as_str().map(str::to_string).ok_or_else(|| format!("{}.{key} must be a string, got {v}", self.name))
            }
        }
    }
}

/// The checkpoint's dtype: `dtype` (v5) or `torch_dtype` (Hub), at the top level or in
/// `text_config`; `float32` when none says.
pub(crate) fn checkpoint_dtype(top: &Fields, text_json: &Value) -> Result<String, String> {
    let field = top.get("dtype").or_else(|| top.get("torch_dtype"));
    match field.or_else(|| text_json.get("dtype")).or_else(|| text_json.get("torch_dtype")) {
        None => Ok("float32".to_string()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("config.dtype must be a string, got {other}")),
    }
}
