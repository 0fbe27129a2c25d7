//! The special tokens that end a turn: a chat template writes them after each message, so a
//! completion ends at one as it ends at the checkpoint's EOS.

/// The special tokens a chat template writes whose names say they end something (`<|im_end|>`,
/// `<|eot_id|>`, `<|end|>`, `<end_of_turn>`): a turn the model writes ends with one.
pub(crate) fn end_of_turn(
    template: &str,
    specials: impl IntoIterator<Item = (u32, String)>,
) -> Vec<u32> {
    let mut out: Vec<u32> = specials
        .into_iter()
        .filter(|(_, name)| {
            let lower = name.to_ascii_lowercase();
            template.contains(name.as_str()) && (lower.contains("end") || lower.contains("eot"))
        })
        .map(|(id, _)| id)
        .collect();
    out.sort_unstable();
    out
}
