// The data's tokenizer and text bytes for a run (core/train/data_text.h).
#include "core/train/data_text.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/data/prepare_meta.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

// `from` to `to_dir`/`name` through a temp name and a rename: a resumed run
// rewrites the same file, and a reader never sees half of it.
void copy_into(const fs::path& from, const fs::path& to_dir, const std::string& name) {
  const fs::path tmp = to_dir / ("." + name + ".tmp." + std::to_string(::getpid()));
  std::error_code ec;
  fs::copy_file(from, tmp, fs::copy_options::overwrite_existing, ec);
  if (!ec) fs::rename(tmp, to_dir / name, ec);
  if (ec) {
    fs::remove(tmp, ec);
    TR_FAIL("output.dir: cannot copy the data's tokenizer file '", from.string(), "' to '", (to_dir / name).string(),
            "': ", ec.message());
  }
}

}  // namespace

double bits_per_byte(double val_loss_nats, double tokens_per_byte) {
  if (val_loss_nats < 0 || tokens_per_byte <= 0) return -1;
  return val_loss_nats * tokens_per_byte / std::log(2.0);
}

namespace {

// The tokenizer prepare.json names beside data.train: loaded when the
// sample needs it, copied into `copy_to` (rank 0's output.dir).
void open_tokenizer(const JobSpec& job, bool need_tokenizer, const std::string& copy_to, DataText& out) {
  PreparedTokenizer rec;
  try {
    rec = prepared_tokenizer(job.data.train, "data.train", true);
  } catch (const Error& e) {
    if (need_tokenizer) throw;
    // Only the sample and `generate`'s convenience need it: training does not.
    TR_LOG_WARN(e.what(), " (training goes on: output.sample_tokens is 0, and ", copy_to,
                " gets no tokenizer.json; pass `trainrun generate --tokenizer` one)");
    return;
  }
  if (rec.path.empty()) return;
  out.tokenizer_path = rec.path;
  if (need_tokenizer) out.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(rec.path));
  if (copy_to.empty()) return;
  const fs::path src(rec.path);
  copy_into(src, copy_to, "tokenizer.json");
  // Its special tokens and chat template: `generate --chat` reads them beside tokenizer.json.
  if (fs::is_regular_file(src.parent_path() / "tokenizer_config.json"))
    copy_into(src.parent_path() / "tokenizer_config.json", copy_to, "tokenizer_config.json");
  TR_LOG_INFO("data: tokenizer ", rec.path, " (", rec.meta_path, "), copied to ", copy_to,
              "/tokenizer.json: the sample and `trainrun generate --checkpoint ", copy_to, "` print text");
}

}  // namespace

DataText open_data_text(const JobSpec& job, bool need_tokenizer, const std::string& copy_to) {
  DataText out;
  if (job.data.format == "synthetic") return out;
  // data.train first: shards that are not there fail on its name, as when the data opens.
  if (need_tokenizer || !copy_to.empty()) open_tokenizer(job, need_tokenizer, copy_to, out);
  if (!job.data.val.empty()) out.val_tokens_per_byte = prepared_val_tokens_per_byte(job.data.val, "data.val");
  if (out.val_tokens_per_byte > 0 && !copy_to.empty())
    TR_LOG_INFO("data: data.val holds ", out.val_tokens_per_byte, " tokens per byte of text (prepare.json): val loss "
                "is also reported in bits per byte (val_bpb = val_loss x tokens/byte / ln 2)");
  return out;
}

}  // namespace trainrun
