// Document offsets from the batch's tokens, and where the separator comes
// from (core/data/document_mask.h).
#include "core/data/document_mask.h"

#include "core/common/error.h"

namespace trainrun {

void document_offsets(const int32_t* inputs, int B, int T, int32_t separator, int32_t* doc_start, int32_t* pos) {
  for (int b = 0; b < B; ++b) {
    const int64_t row = int64_t(b) * T;
    int32_t start = 0;
    for (int t = 0; t < T; ++t) {
      if (inputs[row + t] == separator) start = t;  // the separator opens the document it belongs to
      doc_start[row + t] = start;
      pos[row + t] = t - start;
    }
  }
}

int resolve_document_separator(const JobSpec& job) {
  const DataSpec& d = job.data;
  if (!d.document_mask_on()) return -1;
  int sep = d.document_separator;
  if (sep < 0) {
    TR_CHECK(d.format != "synthetic", "data.document_mask: true needs data.document_separator with data.format ",
             "synthetic (a generated chain has no documents); set data.document_separator to a token id that "
             "starts a document, or turn data.document_mask off");
    sep = prepared_document_start(d.train, "data.train");
    TR_CHECK(sep >= 0, "data.document_mask: true, but data.document_separator is not set and no prepare.json beside ",
             "data.train ('", d.train, "') records the token that starts each document (`trainrun prepare ",
             "--tokenizer` writes it); set data.document_separator to that token id (e.g. 50256 for GPT-2's ",
             "<|endoftext|>, 128000 for Llama 3's <|begin_of_text|>) or turn data.document_mask off");
  }
  TR_CHECK(sep < job.model.vocab_size, "data.document_separator: ", sep, " is not a token id of the model (",
           "model.vocab_size = ", job.model.vocab_size, ")", d.document_separator < 0 ? " (from prepare.json)" : "",
           "; use the id of the token that starts each document");
  return sep;
}

}  // namespace trainrun
