//! How a generated answer becomes a Responses `output`: the text is read token by token with chat's
//! `AnswerReader` (thinking apart, tool calls out), and each piece opens, grows or closes an output item
//! (`reasoning`, `message`, `function_call`), yielding the stream events that say so. The non-streaming
//! answer is built by the same steps, so both show the same items.

use super::super::{chat::AnswerReader, openai::uuid_like};
use crate::{
    api::{
        responses::{OutputContent, OutputItem, StreamEventKind},
        FinishReason,
    },
    engine::TokenEvent,
    text::tool_calls,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextKind {
    Reasoning,
    Message,
}

/// The item being written: its kind, id and text so far.
struct OpenItem {
    kind: TextKind,
    id: String,
    text: String,
}

/// The call being written: its index among the answer's calls, its ids, name and arguments so far.
struct OpenCall {
    index: u32,
    id: String,
    call_id: String,
    name: String,
    arguments: String,
}

impl OpenCall {
    fn item(&self, arguments: String, status: &'static str) -> OutputItem {
        OutputItem::FunctionCall {
            id: self.id.clone(),
            call_id: self.call_id.clone(),
            name: self.name.clone(),
            arguments,
            status,
        }
    }
}

/// Builds the output items of one answer.
pub(super) struct OutputBuilder {
    reader: AnswerReader,
    /// Items done, in order.
    items: Vec<OutputItem>,
    open: Option<OpenItem>,
    /// The call being written (never at once with `open`).
    open_call: Option<OpenCall>,
    /// Answer text that is only whitespace so far and opened no message: a message starts only once
    /// the text shows more (so the blank line around a tool call makes no item).
    blank: String,
    /// Tokens whose text went to the thinking.
    num_reasoning_tokens: u32,
    /// The calls made, with their call ids, for the conversation's history.
    calls: Vec<(String, tool_calls::ToolCall)>,
}

fn text_part(kind: TextKind, text: String) -> OutputContent {
    match kind {
        TextKind::Reasoning => OutputContent::ReasoningText { text },
        TextKind::Message => OutputContent::OutputText {
            text,
            annotations: Vec::new(),
        },
    }
}

fn text_item(kind: TextKind, id: String, status: &'static str, content: Vec<OutputContent>) -> OutputItem {
    match kind {
        TextKind::Reasoning => OutputItem::Reasoning {
            id,
            summary: Vec::new(),
            content,
            status,
        },
        TextKind::Message => OutputItem::Message {
            id,
            role: "assistant",
            status,
            content,
        },
    }
}

impl OutputBuilder {
    pub fn new(reader: AnswerReader) -> Self {
        Self {
            reader,
            items: Vec::new(),
            open: None,
            open_call: None,
            blank: String::new(),
            num_reasoning_tokens: 0,
            calls: Vec::new(),
        }
    }

    /// Reads one token event; returns the stream events it makes.
    pub fn push(&mut self, event: &TokenEvent) -> Vec<StreamEventKind> {
        let mut events = Vec::new();
        let piece = self.reader.push(&event.text, event.end.is_some());
        if !piece.reasoning.is_empty() {
            self.num_reasoning_tokens += 1;
            self.write(TextKind::Reasoning, piece.reasoning, &mut events);
        }
        // A piece's text precedes the calls it starts but follows the end of the call already open
        // (the text after a call, or a cut-off call given back as text).
        let open_index = self.open_call.as_ref().map(|open| open.index);
        let mut open = piece.deltas;
        let num_open = open
            .iter()
            .take_while(|d| d.name.is_none() && Some(d.index) == open_index)
            .count();
        let new = open.split_off(num_open);
        let mut calls = piece.calls.into_iter();
        self.push_deltas(open, &mut calls, &mut events);
        if self.open_call.is_some() {
            self.complete_call(&mut calls, &mut events);
        }
        if !piece.content.is_empty() {
            let is_open = self.open.as_ref().is_some_and(|open| open.kind == TextKind::Message);
            if is_open || !piece.content.trim().is_empty() {
                let text = std::mem::take(&mut self.blank) + &piece.content;
                self.write(TextKind::Message, text, &mut events);
            } else {
                self.blank.push_str(&piece.content);
            }
        }
        self.push_deltas(new, &mut calls, &mut events);
        self.complete_call(&mut calls, &mut events);
        if let Some(end) = &event.end {
            let status = match end.finish_reason {
                FinishReason::Length => "incomplete",
                FinishReason::EosToken | FinishReason::StopSequence => "completed",
            };
            if self.items.is_empty() && self.open.is_none() && self.open_call.is_none() {
                // An answer with nothing to show still answers: one message, maybe empty.
                let text = std::mem::take(&mut self.blank);
                self.open(TextKind::Message, &mut events);
                self.append(text, &mut events);
            }
            self.close(status, &mut events);
        }
        events
    }

    /// The items, once the answer ended.
    pub fn items(&self) -> &[OutputItem] {
        &self.items
    }

    pub fn num_reasoning_tokens(&self) -> u32 {
        self.num_reasoning_tokens
    }

    /// The answer's text and thinking (all items of each kind joined) and its calls with their call ids.
    pub fn answer(&self) -> (String, String, &[(String, tool_calls::ToolCall)]) {
        let (mut text, mut reasoning) = (String::new(), String::new());
        for item in &self.items {
            let (OutputItem::Message { content, .. } | OutputItem::Reasoning { content, .. }) = item else {
                continue;
            };
            for part in content {
                match part {
                    OutputContent::OutputText { text: part, .. } => text.push_str(part),
                    OutputContent::ReasoningText { text: part } => reasoning.push_str(part),
                }
            }
        }
        (text, reasoning, &self.calls)
    }

    /// Adds text of `kind`: to the open item when it is of that kind, else to a new one.
    fn write(&mut self, kind: TextKind, text: String, events: &mut Vec<StreamEventKind>) {
        if self.open.as_ref().is_none_or(|open| open.kind != kind) {
            self.close("completed", events);
            self.open(kind, events);
        }
        self.append(text, events);
    }

    fn open(&mut self, kind: TextKind, events: &mut Vec<StreamEventKind>) {
        let prefix = match kind {
            TextKind::Reasoning => "rs",
            TextKind::Message => "msg",
        };
        let id = format!("{prefix}_{}", uuid_like());
        let output_index = self.items.len() as u32;
        events.push(StreamEventKind::OutputItemAdded {
            output_index,
            item: text_item(kind, id.clone(), "in_progress", Vec::new()),
        });
        events.push(StreamEventKind::ContentPartAdded {
            item_id: id.clone(),
            output_index,
            content_index: 0,
            part: text_part(kind, String::new()),
        });
        self.open = Some(OpenItem {
            kind,
            id,
            text: String::new(),
        });
    }

    fn append(&mut self, delta: String, events: &mut Vec<StreamEventKind>) {
        let output_index = self.items.len() as u32;
        let open = self.open.as_mut().expect("text is appended to an open item");
        open.text.push_str(&delta);
        if delta.is_empty() {
            return;
        }
        let item_id = open.id.clone();
        events.push(match open.kind {
            TextKind::Reasoning => StreamEventKind::ReasoningTextDelta {
                item_id,
                output_index,
                content_index: 0,
                delta,
            },
            TextKind::Message => StreamEventKind::OutputTextDelta {
                item_id,
                output_index,
                content_index: 0,
                delta,
                logprobs: Vec::new(),
            },
        });
    }

    /// Closes the open item, if any, as `status` (a call that did not complete, cut off, as
    /// `incomplete`).
    fn close(&mut self, status: &'static str, events: &mut Vec<StreamEventKind>) {
        if let Some(call) = self.open_call.take() {
            self.close_call(call, "incomplete", events);
        }
        let Some(OpenItem { kind, id, text }) = self.open.take() else {
            return;
        };
        let output_index = self.items.len() as u32;
        events.push(match kind {
            TextKind::Reasoning => StreamEventKind::ReasoningTextDone {
                item_id: id.clone(),
                output_index,
                content_index: 0,
                text: text.clone(),
            },
            TextKind::Message => StreamEventKind::OutputTextDone {
                item_id: id.clone(),
                output_index,
                content_index: 0,
                text: text.clone(),
                logprobs: Vec::new(),
            },
        });
        events.push(StreamEventKind::ContentPartDone {
            item_id: id.clone(),
            output_index,
            content_index: 0,
            part: text_part(kind, text.clone()),
        });
        let item = text_item(kind, id, status, vec![text_part(kind, text)]);
        events.push(StreamEventKind::OutputItemDone {
            output_index,
            item: item.clone(),
        });
        self.items.push(item);
    }

    /// Streams pieces of calls: a call's first adds its item (no arguments yet), each piece of
    /// arguments is a delta. `calls`: the calls the piece completes, in order (the first is the open
    /// call, if any).
    fn push_deltas(
        &mut self,
        deltas: Vec<tool_calls::CallDelta>,
        calls: &mut impl Iterator<Item = tool_calls::ToolCall>,
        events: &mut Vec<StreamEventKind>,
    ) {
        for delta in deltas {
            if let Some(name) = delta.name {
                if self.open_call.is_some() {
                    self.complete_call(calls, events);
                }
                self.close("completed", events);
                let call = OpenCall {
                    index: delta.index,
                    id: format!("fc_{}", uuid_like()),
                    call_id: format!("call_{}", uuid_like()),
                    name,
                    arguments: String::new(),
                };
                events.push(StreamEventKind::OutputItemAdded {
                    output_index: self.items.len() as u32,
                    item: call.item(String::new(), "in_progress"),
                });
                self.open_call = Some(call);
            }
            // (A call's pieces after its item closed, cut off by text, are not sent.)
            let Some(call) = self.open_call.as_mut().filter(|call| call.index == delta.index) else {
                continue;
            };
            if !delta.arguments.is_empty() {
                call.arguments.push_str(&delta.arguments);
                events.push(StreamEventKind::FunctionCallArgumentsDelta {
                    item_id: call.id.clone(),
                    output_index: self.items.len() as u32,
                    delta: delta.arguments,
                });
            }
        }
    }

    /// The open call completes if `calls` has a call (its deltas were streamed): its item is done
    /// with the whole arguments.
    fn complete_call(
        &mut self,
        calls: &mut impl Iterator<Item = tool_calls::ToolCall>,
        events: &mut Vec<StreamEventKind>,
    ) {
        let Some(call) = calls.next() else {
            return;
        };
        let mut open = self.open_call.take().expect("a completed call was streamed");
        open.arguments = call.arguments.clone();
        let call_id = open.call_id.clone();
        self.close_call(open, "completed", events);
        self.calls.push((call_id, call));
    }

    fn close_call(&mut self, call: OpenCall, status: &'static str, events: &mut Vec<StreamEventKind>) {
        let output_index = self.items.len() as u32;
        events.push(StreamEventKind::FunctionCallArgumentsDone {
            item_id: call.id.clone(),
            output_index,
            name: call.name.clone(),
            arguments: call.arguments.clone(),
        });
        let done = call.item(call.arguments.clone(), status);
        events.push(StreamEventKind::OutputItemDone {
            output_index,
            item: done.clone(),
        });
        self.items.push(done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{engine::EndEvent, text::tool_calls::ToolCallFormat};

    /// The events of `text` fed one character at a time, ending as `reason`; and the builder.
    fn feed(text: &str, reason: FinishReason) -> (Vec<StreamEventKind>, OutputBuilder) {
        let reader = AnswerReader::new(None, Some((ToolCallFormat::Hermes, &[])), "");
        let mut builder = OutputBuilder::new(reader);
        let chars: Vec<char> = text.chars().collect();
        let mut events = Vec::new();
        for (i, c) in chars.iter().enumerate() {
            let end = (i + 1 == chars.len()).then(|| EndEvent {
                finish_reason: reason,
                generated_text: String::new(),
                num_generated_tokens: chars.len() as u32,
                num_prompt_tokens: 20,
                num_cached_tokens: 0,
                stop_sequence: None,
            });
            let event = TokenEvent {
                token_id: 0,
                text: c.to_string(),
                logprob: 0.0,
                is_special: false,
                top_logprobs: Vec::new(),
                end,
            };
            events.extend(builder.push(&event));
        }
        (events, builder)
    }

    fn names(events: &[StreamEventKind]) -> Vec<&'static str> {
        events.iter().map(StreamEventKind::name).collect()
    }

    /// Text and a call make exactly the Responses event sequence, the call's arguments streamed as
    /// they are written; the items agree with what the events accumulate to.
    #[test]
    fn a_call_streams_its_arguments_as_they_are_written() {
        let text =
            "Checking.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n";
        let (events, builder) = feed(text, FinishReason::EosToken);
        let arguments = r#"{"city":"Paris"}"#;
        let expected = [
            vec!["response.output_item.added", "response.content_part.added"],
            vec!["response.output_text.delta"; "Checking.\n".len()],
            vec![
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
            ],
            vec!["response.function_call_arguments.delta"; arguments.len()], // a character each
            vec!["response.function_call_arguments.done", "response.output_item.done"],
        ]
        .concat();
        assert_eq!(names(&events), expected);
        let [_, OutputItem::FunctionCall {
            id,
            name,
            arguments: whole,
            status,
            ..
        }] = builder.items()
        else {
            panic!("{:?}", builder.items());
        };
        assert_eq!(
            (name.as_str(), whole.as_str(), *status),
            ("weather", arguments, "completed")
        );
        let pieces: String = events
            .iter()
            .filter_map(|event| match event {
                StreamEventKind::FunctionCallArgumentsDelta {
                    item_id,
                    output_index: 1,
                    delta,
                } if item_id == id => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(pieces, arguments);
        match &events[events.len() - 2..] {
            [StreamEventKind::FunctionCallArgumentsDone { arguments: done, .. }, StreamEventKind::OutputItemDone { output_index: 1, item }] =>
            {
                let json = |item| serde_json::to_value(item).expect("serializes");
                assert_eq!((done, json(item)), (whole, json(&builder.items()[1])))
            }
            other => panic!("{other:?}"),
        }
        match &events[events.len() - 3 - arguments.len()] {
            StreamEventKind::OutputItemAdded {
                output_index: 1,
                item: OutputItem::FunctionCall { arguments, status, .. },
            } => {
                assert_eq!((arguments.as_str(), *status), ("", "in_progress"))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(builder.answer().2.len(), 1);
    }

    /// A call cut off by `max_tokens`: its item is done `incomplete` with the arguments streamed; its
    /// text is given back as a message (as chat gives it back as content).
    #[test]
    fn a_cut_off_call_is_incomplete_and_its_text_follows() {
        let text = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Pa";
        let (events, builder) = feed(text, FinishReason::Length);
        let arguments = r#"{"city":"Pa"#;
        let expected = [
            vec!["response.output_item.added"],
            vec!["response.function_call_arguments.delta"; arguments.len()],
            vec![
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ],
        ]
        .concat();
        assert_eq!(names(&events), expected);
        match builder.items() {
            [OutputItem::FunctionCall {
                arguments: got,
                status: "incomplete",
                ..
            }, OutputItem::Message {
                status: "incomplete", ..
            }] => {
                assert_eq!(got, arguments)
            }
            other => panic!("{other:?}"),
        }
        let (answer, _, calls) = builder.answer();
        assert_eq!((answer.as_str(), calls.len()), (text, 0));
    }
}
