//! Chat templates, rendered the way transformers does: Jinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python string methods (`.upper()`, `.strip()`…),
//! `raise_exception`, `tojson` as Python's `json.dumps` writes JSON, mappings in the
//! order they were given, and `bos_token` / `eos_token` in scope.

use minijinja::{Environment, ErrorKind, Value, context};

use crate::{TextError, TextTokenizer};

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(source: String, tokenizer: &TextTokenizer) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // transformers' `tojson` (Python's json.dumps), not minijinja's HTML-safe one:
        // tool schemas reach the prompt as the model was trained to see them.
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(NAME, source).map_err(|e| TextError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: tokenizer.bos_token().unwrap_or_default().to_string(),
            eos_token: tokenizer.eos_token().unwrap_or_default().to_string(),
        })
    }

    /// Renders `messages` (transformers' form: `content` a string or a list of parts such
    /// as `{"type":"text","text":…}` and `{"type":"image"}`), with the request's `tools`
    /// (OpenAI's list; undefined without).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| TextError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| TextError::Template(e.to_string()))
    }
}

/// `tojson(indent=None, separators=None, sort_keys=False)` as transformers defines it:
/// `json.dumps(x, ensure_ascii=False, …)`, so `", "` and `": "` between items unless
/// indented (then `","`), keys in their order, nothing escaped for HTML.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
        None => None,
    };
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = JsonStyle { indent, item, key, sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// How Python's `json.dumps` lays JSON out.
struct JsonStyle {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(unit) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(unit);
            }
        }
    }

    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(level + 1, out);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            J::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &J)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(level + 1, out);
                    out.push_str(&J::String(k.clone()).to_string());
                    out.push_str(&self.key);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
            // Scalars and empty containers as serde_json writes them, which for strings is
            // Python's escaping with ensure_ascii=False.
            other => out.push_str(&other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, data: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.add_template_owned("t", source.to_string()).unwrap();
        env.get_template("t").unwrap().render(context! { x => Value::from_serialize(&data) }).unwrap()
    }

    /// The expected strings are Python's `json.dumps(x, ensure_ascii=False, …)`.
    #[test]
    fn tojson_writes_what_python_writes() {
        let x = serde_json::json!({"name": "get_weather", "b": [1, 2.5, true, null], "a": {"é": "<tag> & \"q\"\n"}, "e": {}, "l": []});
        assert_eq!(
            render("{{ x | tojson }}", x.clone()),
            r#"{"name": "get_weather", "b": [1, 2.5, true, null], "a": {"é": "<tag> & \"q\"\n"}, "e": {}, "l": []}"#
        );
        assert_eq!(render("{{ x.b | tojson(indent=2) }}", x.clone()), "[\n  1,\n  2.5,\n  true,\n  null\n]");
        assert_eq!(
            render("{{ x | tojson(separators=[',', ':'], sort_keys=true) }}", x),
            r#"{"a":{"é":"<tag> & \"q\"\n"},"b":[1,2.5,true,null],"e":{},"l":[],"name":"get_weather"}"#
        );
    }
}
