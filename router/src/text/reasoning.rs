//! Reasoning models' thinking, split from the answer (`--reasoning-parser`): the text between
//! `<think>` and `</think>` becomes `reasoning_content`, the rest `content`. Text arrives in pieces;
//! a possible marker is held back until the next piece settles it, so any split gives the same result.
//!
//! Where the reasoning starts: `deepseek_r1`'s template opens `<think>` itself, so its answer starts
//! inside the reasoning (an opening `<think>` the model writes anyway is dropped); `qwen3` reasons only
//! when the answer starts with `<think>`. Either way, a prompt whose last `<think>` is still open starts
//! inside it, and one whose last `</think>` closed it (e.g. Qwen3 with `enable_thinking: false`) starts
//! in the answer. Whitespace between `</think>` and the answer is dropped.

/// Marks the start of the reasoning.
pub const THINK_START: &str = "<think>";
/// Marks its end; a grammar applies only after it (`GrammarSpec::after_reasoning`).
pub const THINK_END: &str = "</think>";

/// Which convention the model follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum ReasoningFormat {
    /// DeepSeek-R1: the answer starts inside the reasoning; `</think>` ends it.
    DeepseekR1,
    /// Qwen3: `<think>...</think>` when the answer starts with it.
    Qwen3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The answer may still open with `<think>`.
    BeforeStart,
    InReasoning,
    /// Whitespace after `</think>` is still dropped.
    AfterEnd,
    InContent,
}

/// What a push let through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// One answer's reasoning splitter.
#[derive(Debug)]
pub struct ReasoningParser {
    format: ReasoningFormat,
    state: State,
    /// Text not let through yet.
    pending: String,
}

impl ReasoningParser {
    /// A splitter for an answer to `prompt` (the rendered chat prompt).
    pub fn new(format: ReasoningFormat, prompt: &str) -> Self {
        let (last_start, last_end) = (prompt.rfind(THINK_START), prompt.rfind(THINK_END));
        let state = match (last_start, last_end) {
            (Some(start), end) if end.is_none_or(|end| end < start) => State::InReasoning,
            (_, Some(_)) => State::AfterEnd,
            _ => State::BeforeStart,
        };
        Self {
            format,
            state,
            pending: String::new(),
        }
    }

    /// Where the answer starts: `Some(true)` inside the thinking, `Some(false)` where it may open
    /// with `<think>`, `None` past it (no thinking to come).
    pub fn starts_in_reasoning(&self) -> Option<bool> {
        match self.state {
            State::InReasoning => Some(true),
            State::BeforeStart => Some(self.format == ReasoningFormat::DeepseekR1),
            State::AfterEnd | State::InContent => None,
        }
    }

    pub fn push(&mut self, text: &str) -> Split {
        self.pending.push_str(text);
        let mut split = Split::default();
        loop {
            match self.state {
                State::BeforeStart => {
                    let trimmed = self.pending.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(THINK_START) {
                        self.pending = rest.to_owned();
                        self.state = State::InReasoning;
                    } else if THINK_START.starts_with(trimmed) {
                        return split;
                    } else if self.format == ReasoningFormat::DeepseekR1 {
                        // Its template opened the reasoning (a `<think>` of its own is dropped above).
                        self.state = State::InReasoning;
                    } else {
                        self.state = State::InContent;
                    }
                }
                State::InReasoning => {
                    if let Some(end) = self.pending.find(THINK_END) {
                        split.reasoning.push_str(&self.pending[..end]);
                        self.pending.drain(..end + THINK_END.len());
                        self.state = State::AfterEnd;
                        continue;
                    }
                    let keep = super::held_len(&self.pending, THINK_END);
                    split.reasoning.extend(self.pending.drain(..self.pending.len() - keep));
                    return split;
                }
                State::AfterEnd => {
                    let trimmed = self.pending.trim_start();
                    if trimmed.is_empty() {
                        self.pending.clear();
                        return split;
                    }
                    self.pending = trimmed.to_owned();
                    self.state = State::InContent;
                }
                State::InContent => {
                    split.content.push_str(&std::mem::take(&mut self.pending));
                    return split;
                }
            }
        }
    }

    /// The end of the answer: what was held back.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::InReasoning => Split {
                reasoning: rest,
                content: String::new(),
            },
            _ => Split {
                reasoning: String::new(),
                content: rest,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split of `text` into two pieces, and one char at a time, gives the same result.
    fn check(format: ReasoningFormat, prompt: &str, text: &str, reasoning: &str, content: &str) {
        let run = |cuts: &[usize]| {
            let mut parser = ReasoningParser::new(format, prompt);
            let mut all = Split::default();
            let mut start = 0;
            for &cut in cuts.iter().chain([&text.len()]) {
                let split = parser.push(&text[start..cut]);
                all.reasoning.push_str(&split.reasoning);
                all.content.push_str(&split.content);
                start = cut;
            }
            let split = parser.finish();
            all.reasoning.push_str(&split.reasoning);
            all.content.push_str(&split.content);
            all
        };
        let expected = Split {
            reasoning: reasoning.into(),
            content: content.into(),
        };
        let boundaries: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        assert_eq!(run(&[]), expected, "{text:?} whole");
        assert_eq!(run(&boundaries), expected, "{text:?} char by char");
        for &i in &boundaries {
            assert_eq!(run(&[i]), expected, "{text:?} cut at {i}");
        }
    }

    #[test]
    fn qwen3_reasons_only_after_an_opening_think() {
        let prompt = "<|im_start|>assistant\n";
        check(
            ReasoningFormat::Qwen3,
            prompt,
            "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.",
            "\nHmm, 2+2.\n",
            "It is 4.",
        );
        check(ReasoningFormat::Qwen3, prompt, "It is <4>.", "", "It is <4>.");
        check(ReasoningFormat::Qwen3, prompt, "<thin", "", "<thin");
        check(
            ReasoningFormat::Qwen3,
            prompt,
            "<think>cut off </thi",
            "cut off </thi",
            "",
        );
    }

    #[test]
    fn deepseek_r1_starts_inside_the_reasoning() {
        let prompt = "<｜Assistant｜><think>\n";
        check(ReasoningFormat::DeepseekR1, prompt, "Hmm.</think>4", "Hmm.", "4");
        check(ReasoningFormat::DeepseekR1, "", "<think>Hmm.</think> 4", "Hmm.", "4");
        check(ReasoningFormat::DeepseekR1, "", "no end", "no end", "");
    }

    #[test]
    fn a_prompt_that_closed_the_reasoning_starts_in_the_answer() {
        let prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
        check(ReasoningFormat::Qwen3, prompt, "It is 4.", "", "It is 4.");
        check(ReasoningFormat::DeepseekR1, prompt, "\nIt is 4.", "", "It is 4.");
    }
}
