//! Tool calling: OpenAI's `tools` and `tool_choice` checked, the output constraint that
//! `"required"` or a named function imposes, and the reading of generated text into
//! `tool_calls`, token by token (a non-streamed answer is read by the same machine, so
//! the two always agree).
//!
//! Output formats, by `tool_choice`:
//! - a named function: the output is that function's arguments (constrained to its
//!   parameters' schema), streamed as argument fragments; `finish_reason` stays `stop`,
//!   as OpenAI's does;
//! - `"required"`: the output is a JSON array of `{"name", "parameters"}` (constrained to
//!   the tools' schemas, at least one call), read when it is complete;
//! - `"auto"`: the model's own format, Hermes-style `<tool_call>{"name", "arguments"}</tool_call>`
//!   blocks (Qwen2 and Qwen2.5's templates), anywhere in free text;
//! - `"none"`: text only (the tools still reach the template, as vLLM does).

use mmserve_protocol::Constraint;
use serde::Serialize;
use serde_json::{Value, json};

/// The most tools a request may declare.
const MAX_TOOLS: usize = 128;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// How a server reads a model's own tool calls (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolParser {
    /// Hermes when the chat template writes `<tool_call>`, else none.
    Auto,
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2, Qwen2.5, Hermes).
    Hermes,
    /// The model has no tool-call format: `tool_choice: "auto"` is refused.
    None,
}

impl ToolParser {
    /// The parser in effect for a chat template.
    pub fn resolve(self, template_source: &str) -> ToolParser {
        match self {
            ToolParser::Auto if template_source.contains(OPEN) => ToolParser::Hermes,
            ToolParser::Auto => ToolParser::None,
            other => other,
        }
    }
}

/// What a request's `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone)]
pub struct Tools {
    pub mode: Mode,
    /// The tools as given (`{"type": "function", "function": {…}}`), for the template.
    pub list: Value,
    /// Each function's name and its parameters' schema.
    functions: Vec<(String, Value)>,
    /// `parallel_tool_calls: false`: at most one call.
    single: bool,
}

type Refusal = (&'static str, String);

impl Tools {
    /// Reads `tools` and `tool_choice`; `None` without tools. A refusal names its field.
    pub fn parse(tools: Option<&Value>, choice: Option<&Value>, parser: ToolParser) -> Result<Option<Tools>, Refusal> {
        let tools = tools.filter(|t| !t.is_null());
        let choice = choice.filter(|c| !c.is_null());
        let Some(tools) = tools else {
            return match choice.map(|c| c.as_str()) {
                None | Some(Some("none")) => Ok(None),
                _ => Err(("tool_choice", "tool_choice needs `tools`".into())),
            };
        };
        let list = tools.as_array().ok_or(("tools", "tools must be a list".to_string()))?;
        if list.is_empty() || list.len() > MAX_TOOLS {
            return Err(("tools", format!("tools must hold from 1 to {MAX_TOOLS} tools")));
        }
        let mut functions = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(("tools", format!("tools[{i}]: only tools of type \"function\" are supported")));
            }
            let f = t.get("function").ok_or_else(|| ("tools", format!("tools[{i}] needs `function`")))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| ("tools", format!("tools[{i}].function needs a `name`")))?;
            let params = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => return Err(("tools", format!("tools[{i}].function.parameters must be a JSON schema"))),
            };
            if functions.iter().any(|(n, _)| n == name) {
                return Err(("tools", format!("two tools are named {name:?}")));
            }
            functions.push((name.to_string(), params));
        }
        let mode = match choice {
            None => Mode::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Mode::None,
                "auto" => Mode::Auto,
                "required" => Mode::Required,
                _ => return Err(("tool_choice", "tool_choice must be none, auto, required or a function".into())),
            },
            Some(obj) => {
                let name = obj
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or(("tool_choice", "a named tool_choice needs `function.name`".to_string()))?;
                if !functions.iter().any(|(n, _)| n == name) {
                    return Err(("tool_choice", format!("tool_choice names {name:?}, which is not among the tools")));
                }
                Mode::Named(name.to_string())
            }
        };
        if mode == Mode::Auto && parser == ToolParser::None {
            return Err((
                "tool_choice",
                "this model's chat template has no tool-call format, so tool_choice \"auto\" (the default with tools) \
                 cannot be read: use \"required\" or a named function, or start the server with --tool-call-parser hermes"
                    .into(),
            ));
        }
        Ok(Some(Tools { mode, list: tools.clone(), functions, single: false }))
    }

    /// With `single`, at most one call is made: `"required"` asks for one, and `"auto"`
    /// reads the first (later ones are not said).
    pub fn at_most_one_call(mut self, single: bool) -> Tools {
        self.single = single;
        self
    }

    /// The constraint the output must meet: `"required"` and a named function only.
    pub fn constraint(&self) -> Option<Constraint> {
        let schema = match &self.mode {
            Mode::None | Mode::Auto => return None,
            Mode::Named(name) => self.functions.iter().find(|(n, _)| n == name).map(|(_, p)| p.clone())?,
            Mode::Required => {
                let calls: Vec<Value> = self
                    .functions
                    .iter()
                    .map(|(name, params)| {
                        json!({
                            "type": "object",
                            "properties": {"name": {"const": name}, "parameters": params},
                            "required": ["name", "parameters"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if self.single {
                    schema["maxItems"] = json!(1);
                }
                schema
            }
        };
        Some(Constraint::JsonSchema(schema.to_string()))
    }

    /// The reader of one choice's output; the calls it finds are named `call_ids`
    /// followed by their index.
    pub fn reader(&self, call_ids: String) -> Reader {
        Reader {
            mode: self.mode.clone(),
            prefix: call_ids,
            single: self.single,
            calls: 0,
            buf: String::new(),
            in_call: false,
            held: String::new(),
        }
    }
}

/// One call in a message (OpenAI's `tool_calls` entry).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: Function,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Function {
    pub name: String,
    pub arguments: String,
}

/// A piece of a streamed call (OpenAI's `delta.tool_calls` entry): the first piece of a
/// call carries its id and name.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// What a piece of output becomes.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    Call(CallDelta),
}

/// Reads one choice's output as it arrives.
#[derive(Debug)]
pub struct Reader {
    mode: Mode,
    prefix: String,
    single: bool,
    calls: u32,
    /// Output not yet read: a whole `"required"` answer, or an open Hermes block.
    buf: String,
    in_call: bool,
    /// Content held back: trailing whitespace (dropped if a call follows) and a possible
    /// start of `<tool_call>`.
    held: String,
}

impl Reader {
    /// Whether any call was read.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// The finish reason a client sees for the engine's `reason`.
    pub fn finish_reason(&self, reason: &'static str) -> &'static str {
        match self.mode {
            Mode::Auto | Mode::Required if self.called() && reason == "stop" => "tool_calls",
            _ => reason,
        }
    }

    fn start_call(&mut self, name: String, arguments: String) -> Piece {
        let index = self.calls;
        self.calls += 1;
        Piece::Call(CallDelta {
            index,
            id: Some(format!("{}{index}", self.prefix)),
            kind: Some("function"),
            function: FunctionDelta { name: Some(name), arguments },
        })
    }

    /// Reads the next text; returns what can be said of it now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.mode.clone() {
            Mode::None => push_content(&mut out, text.to_string()),
            Mode::Named(name) => {
                if self.calls == 0 {
                    let first = self.start_call(name, text.to_string());
                    out.push(first);
                } else if !text.is_empty() {
                    out.push(Piece::Call(CallDelta {
                        index: 0,
                        id: None,
                        kind: None,
                        function: FunctionDelta { name: None, arguments: text.to_string() },
                    }));
                }
            }
            Mode::Required => self.buf.push_str(text),
            Mode::Auto => {
                self.buf.push_str(text);
                self.read_hermes(&mut out);
            }
        }
        out
    }

    /// The output has ended: says what is left.
    pub fn end(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.mode {
            Mode::None | Mode::Named(_) => {}
            Mode::Required => {
                let text = std::mem::take(&mut self.buf);
                match parse_required(&text) {
                    Some(calls) if !calls.is_empty() => {
                        for (name, args) in calls {
                            let call = self.start_call(name, args);
                            out.push(call);
                        }
                    }
                    // Cut short (length) or unreadable: the text as it is.
                    _ => push_content(&mut out, text),
                }
            }
            Mode::Auto => {
                // An unclosed block is text; held whitespace is said unless a call was read.
                let mut rest = std::mem::take(&mut self.held);
                if self.in_call {
                    rest.push_str(OPEN);
                    rest.push_str(&std::mem::take(&mut self.buf));
                } else {
                    rest.push_str(&std::mem::take(&mut self.buf));
                }
                if self.called() && rest.trim().is_empty() {
                    rest.clear();
                }
                push_content(&mut out, rest);
            }
        }
        out
    }

    fn read_hermes(&mut self, out: &mut Vec<Piece>) {
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CLOSE) else { return };
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + CLOSE.len());
                self.in_call = false;
                match parse_hermes(&body) {
                    Some((name, args)) => {
                        self.held.clear(); // whitespace before a call is layout
                        if !(self.single && self.called()) {
                            let call = self.start_call(name, args);
                            out.push(call);
                        }
                    }
                    None => {
                        let raw = format!("{}{OPEN}{body}{CLOSE}", std::mem::take(&mut self.held));
                        push_content(out, raw);
                    }
                }
                continue;
            }
            match self.buf.find(OPEN) {
                Some(start) => {
                    let before: String = self.buf[..start].to_string();
                    self.buf.drain(..start + OPEN.len());
                    self.say(out, &before);
                    self.in_call = true;
                }
                None => {
                    // Keep back what may be the start of a tag.
                    let keep = partial_tag_len(&self.buf);
                    let text: String = self.buf[..self.buf.len() - keep].to_string();
                    self.buf.drain(..self.buf.len() - keep);
                    self.say(out, &text);
                    return;
                }
            }
        }
    }

    /// Says content, holding back its trailing whitespace.
    fn say(&mut self, out: &mut Vec<Piece>, text: &str) {
        self.held.push_str(text);
        let cut = self.held.trim_end().len();
        if cut > 0 {
            let said: String = self.held.drain(..cut).collect();
            push_content(out, said);
        }
    }
}

fn push_content(out: &mut Vec<Piece>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(Piece::Content(last)) = out.last_mut() {
        last.push_str(&text);
    } else {
        out.push(Piece::Content(text));
    }
}

/// The length of the longest suffix of `s` that begins `<tool_call>`.
fn partial_tag_len(s: &str) -> usize {
    (1..OPEN.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && OPEN.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// A Hermes block's `{"name", "arguments"}`: the name and the arguments as JSON text.
fn parse_hermes(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some((name, args))
}

/// A `"required"` answer: `[{"name", "parameters"}, …]`.
fn parse_required(text: &str) -> Option<Vec<(String, String)>> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    v.as_array()?
        .iter()
        .map(|c| Some((c.get("name")?.as_str()?.to_string(), c.get("parameters").unwrap_or(&json!({})).to_string())))
        .collect()
}

/// What a choice's next text says: as it is without tools, else as `reader` reads it
/// (with what is left when the output has `ended`).
pub fn read(reader: Option<&mut Reader>, text: String, ended: bool) -> Vec<Piece> {
    match reader {
        None if text.is_empty() => Vec::new(),
        None => vec![Piece::Content(text)],
        Some(r) => {
            let mut pieces = r.push(&text);
            if ended {
                pieces.extend(r.end());
            }
            pieces
        }
    }
}

/// Gathers pieces into a message's content and calls (a non-streamed answer).
pub fn gather(pieces: impl IntoIterator<Item = Piece>) -> (Option<String>, Vec<ToolCall>) {
    let (mut content, mut calls) = (None::<String>, Vec::<ToolCall>::new());
    for p in pieces {
        match p {
            Piece::Content(t) => content.get_or_insert_with(String::new).push_str(&t),
            Piece::Call(d) => match (d.id, d.function.name) {
                (Some(id), Some(name)) => calls.push(ToolCall {
                    id,
                    kind: "function",
                    function: Function { name, arguments: d.function.arguments },
                }),
                _ => {
                    if let Some(c) = calls.get_mut(d.index as usize) {
                        c.function.arguments.push_str(&d.function.arguments);
                    }
                }
            },
        }
    }
    (content, calls)
}

/// An assistant message's `tool_calls` in the form chat templates read: `arguments` as
/// an object (a client sends the JSON text), as transformers' templates expect.
pub fn calls_for_template(calls: &Value, at: &str) -> Result<Value, String> {
    let list = calls.as_array().ok_or_else(|| format!("{at}.tool_calls must be a list"))?;
    let mut out = Vec::with_capacity(list.len());
    for (k, c) in list.iter().enumerate() {
        let f = c.get("function").ok_or_else(|| format!("{at}.tool_calls[{k}] needs `function`"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{at}.tool_calls[{k}].function needs `name`"))?;
        let arguments = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .map_err(|e| format!("{at}.tool_calls[{k}].function.arguments is not JSON: {e}"))?,
            Some(v @ Value::Object(_)) => v.clone(),
            None | Some(Value::Null) => json!({}),
            Some(_) => return Err(format!("{at}.tool_calls[{k}].function.arguments must be JSON text")),
        };
        let mut call = json!({"type": "function", "function": {"name": name, "arguments": arguments}});
        if let Some(id) = c.get("id") {
            call["id"] = id.clone();
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests;
