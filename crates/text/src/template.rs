//! Chat templates, rendered the way transformers does: Jinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python string methods (`.upper()`, `.strip()`…),
//! `raise_exception`, and `bos_token` / `eos_token` in scope.

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
    /// as `{"type":"text","text":…}` and `{"type":"image"}`).
    pub fn render(&self, messages: &serde_json::Value, add_generation_prompt: bool) -> Result<String, TextError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| TextError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| TextError::Template(e.to_string()))
    }
}
