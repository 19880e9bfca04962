use super::*;

fn weather() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "noop"}}])
}

fn tools(choice: Value) -> Tools {
    Tools::parse(Some(&weather()), Some(&choice), ToolParser::Hermes).unwrap().unwrap()
}

/// Reads `text` cut into pieces at `cuts`, gathered as a message.
fn read(t: &Tools, text: &str, cuts: &[usize]) -> (Option<String>, Vec<ToolCall>, &'static str) {
    let mut r = t.reader("call-".into());
    let mut pieces = Vec::new();
    let mut last = 0;
    for &c in cuts.iter().chain([text.len()].iter()) {
        if c < last || !text.is_char_boundary(c) {
            continue;
        }
        pieces.extend(r.push(&text[last..c]));
        last = c;
    }
    pieces.extend(r.end());
    let (content, calls) = gather(pieces);
    (content, calls, r.finish_reason("stop"))
}

#[test]
fn requests_are_checked_by_field() {
    let bad =
        |tools: Value, choice: Value| Tools::parse(Some(&tools), Some(&choice), ToolParser::Hermes).unwrap_err().0;
    assert_eq!(bad(json!({}), Value::Null), "tools");
    assert_eq!(bad(json!([{"type": "retrieval"}]), Value::Null), "tools");
    assert_eq!(bad(json!([{"type": "function", "function": {}}]), Value::Null), "tools");
    assert_eq!(bad(weather(), json!("sometimes")), "tool_choice");
    assert_eq!(bad(weather(), json!({"type": "function", "function": {"name": "other"}})), "tool_choice");
    let dup = json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]);
    assert_eq!(bad(dup, Value::Null), "tools");
    // tool_choice without tools; "auto" where the model has no format.
    assert_eq!(Tools::parse(None, Some(&json!("required")), ToolParser::Hermes).unwrap_err().0, "tool_choice");
    assert!(Tools::parse(None, Some(&json!("none")), ToolParser::Hermes).unwrap().is_none());
    assert_eq!(Tools::parse(Some(&weather()), None, ToolParser::None).unwrap_err().0, "tool_choice");
    assert!(Tools::parse(Some(&weather()), Some(&json!("required")), ToolParser::None).is_ok());
    assert_eq!(tools(Value::Null).mode, Mode::Auto);
}

#[test]
fn the_parser_follows_the_template() {
    assert_eq!(ToolParser::Auto.resolve("{{ '<tool_call>' }}"), ToolParser::Hermes);
    assert_eq!(ToolParser::Auto.resolve("USER: "), ToolParser::None);
    assert_eq!(ToolParser::Hermes.resolve("USER: "), ToolParser::Hermes);
}

#[test]
fn only_required_and_named_constrain() {
    assert!(tools(json!("auto")).constraint().is_none());
    assert!(tools(json!("none")).constraint().is_none());
    let Some(Constraint::JsonSchema(s)) =
        tools(json!({"type": "function", "function": {"name": "get_weather"}})).constraint()
    else {
        panic!()
    };
    assert_eq!(serde_json::from_str::<Value>(&s).unwrap()["required"], json!(["city"]));
    let Some(Constraint::JsonSchema(s)) = tools(json!("required")).constraint() else { panic!() };
    let s: Value = serde_json::from_str(&s).unwrap();
    assert_eq!(s["minItems"], 1);
    assert_eq!(s["items"]["anyOf"][1]["properties"]["name"]["const"], "noop");
}

#[test]
fn hermes_blocks_become_calls_however_the_text_is_cut() {
    let t = tools(json!("auto"));
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"noop\"}</tool_call>\n";
    for a in 0..text.len() {
        for b in [a, a + 1, a + 7, a + 13] {
            let (content, calls, finish) = read(&t, text, &[a, b.min(text.len())]);
            assert_eq!(content.as_deref(), Some("Let me check."), "cut at {a}, {b}");
            assert_eq!(calls.len(), 2);
            assert_eq!(calls[0].id, "call-0");
            assert_eq!(calls[0].function.name, "get_weather");
            assert_eq!(serde_json::from_str::<Value>(&calls[0].function.arguments).unwrap(), json!({"city": "Paris"}));
            assert_eq!(calls[1].function.arguments, "{}");
            assert_eq!(finish, "tool_calls");
        }
    }
}

#[test]
fn text_without_a_readable_call_is_kept_exactly() {
    let t = tools(json!("auto"));
    for text in
        ["plain answer  \n", "a <tool_ b", "x <tool_call>{not json}</tool_call> y", "open <tool_call>{\"name\"", "  "]
    {
        for cut in 0..text.len() {
            let (content, calls, finish) = read(&t, text, &[cut]);
            assert_eq!(content.as_deref(), Some(text), "{text:?} cut at {cut}");
            assert!(calls.is_empty());
            assert_eq!(finish, "stop");
        }
    }
}

#[test]
fn required_answers_are_read_whole() {
    let t = tools(json!("required"));
    let text = r#"[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "noop", "parameters": {}}]"#;
    let (content, calls, finish) = read(&t, text, &[5, 40]);
    assert_eq!(content, None);
    assert_eq!(
        (calls[0].function.name.as_str(), calls[0].function.arguments.as_str()),
        ("get_weather", r#"{"city":"Oslo"}"#)
    );
    assert_eq!(calls[1].id, "call-1");
    assert_eq!(finish, "tool_calls");
    // Cut short: the text as it is.
    let (content, calls, finish) = read(&t, &text[..30], &[]);
    assert_eq!((content.as_deref(), calls.len(), finish), (Some(&text[..30]), 0, "stop"));
}

#[test]
fn a_named_function_streams_its_arguments() {
    let t = tools(json!({"type": "function", "function": {"name": "get_weather"}}));
    let mut r = t.reader("c-".into());
    let first = r.push("{\"ci");
    let Piece::Call(d) = &first[0] else { panic!() };
    assert_eq!((d.id.as_deref(), d.function.name.as_deref()), (Some("c-0"), Some("get_weather")));
    let second = r.push("ty\": \"Rome\"}");
    let Piece::Call(d) = &second[0] else { panic!() };
    assert_eq!((d.id.as_ref(), d.function.name.as_ref()), (None, None));
    let (content, calls) = gather(first.into_iter().chain(second).chain(r.end()));
    assert_eq!(content, None);
    assert_eq!(calls[0].function.arguments, "{\"city\": \"Rome\"}");
    assert_eq!(r.finish_reason("stop"), "stop", "OpenAI's finish for a named function");
}

#[test]
fn assistant_calls_reach_the_template_as_objects() {
    let calls = json!([{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
    let v = calls_for_template(&calls, "messages[1]").unwrap();
    assert_eq!(v[0]["function"]["arguments"], json!({"a": 1}));
    assert_eq!(v[0]["id"], "x");
    let bad = json!([{"function": {"name": "f", "arguments": "{"}}]);
    assert!(calls_for_template(&bad, "messages[1]").unwrap_err().contains("messages[1].tool_calls[0]"));
}

/// Random texts of tags, half tags, JSON, whitespace and multi-byte characters, cut at
/// random places: the reading never depends on where the text was cut (what streams is
/// what a whole answer says), and nothing is lost when no call is read.
#[test]
fn any_text_reads_the_same_however_it_is_cut() {
    let parts = [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "_call>",
        "</tool",
        "{\"name\": \"noop\"}",
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}",
        "{bad",
        " ",
        "\n",
        "日本",
        "é",
        "text",
        "<",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    for mode in [json!("auto"), json!("required"), json!({"type": "function", "function": {"name": "noop"}})] {
        let t = tools(mode);
        for _ in 0..400 {
            let text: String = (0..1 + next(12)).map(|_| parts[next(parts.len())]).collect();
            let whole = read(&t, &text, &[]);
            let mut cuts: Vec<usize> = (0..next(6)).map(|_| next(text.len() + 1)).collect();
            cuts.sort_unstable();
            assert_eq!(read(&t, &text, &cuts), whole, "{text:?} cut at {cuts:?}");
            if whole.1.is_empty() && t.mode == Mode::Auto {
                assert_eq!(whole.0.as_deref().unwrap_or(""), text, "no call read: the text as it was");
            }
        }
    }
}
