// The KV-cache memory calculator: how much memory a model's cache takes, per format, and how many
// tokens fit in a given amount.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <kvkit/layout/kv_memory.hpp>

namespace {

const kvkit::model_config* find_model(std::string_view name) {
  for (const auto& m : kvkit::models::all) {
    if (m.name.starts_with(name)) {
      return &m;
    }
  }
  return nullptr;
}

void table(const kvkit::model_config& m, std::int64_t tokens, std::int64_t batch,
           std::int32_t page_size, double memory_gib) {
  std::printf("\n%s: %d layers, %d query heads, %d KV heads, head_dim %d; %lld tokens x batch "
              "%lld, pages of %d tokens\n",
              std::string(m.name).c_str(), m.num_layers, m.num_query_heads, m.num_kv_heads,
              m.head_dim, static_cast<long long>(tokens), static_cast<long long>(batch), page_size);
  std::printf("  %-13s %12s %12s %12s %10s %16s\n", "format (K=V)", "bytes/token", "GB", "GiB",
              "vs fp16", "tokens in memory");
  const double base = static_cast<double>(*kvkit::kv_bytes_paged(
      m, kvkit::kv_format::fp16, kvkit::kv_format::fp16, tokens, batch, page_size));
  for (const auto f : kvkit::all_kv_formats) {
    const auto bytes = kvkit::kv_bytes_paged(m, f, f, tokens, batch, page_size);
    if (!bytes) {
      std::printf("  %-13s %s\n", std::string(kvkit::to_string(f)).c_str(),
                  std::string(kvkit::to_string(bytes.error())).c_str());
      continue;
    }
    const auto fit = kvkit::tokens_that_fit(
        m, f, f, static_cast<std::int64_t>(memory_gib * (1LL << 30)), page_size);
    const double per_token =
        static_cast<double>(*kvkit::page_bytes(m, f, f, page_size)) * m.num_layers / page_size;
    std::printf("  %-13s %12.0f %12.2f %12.2f %9.2fx %16lld\n",
                std::string(kvkit::to_string(f)).c_str(), per_token,
                static_cast<double>(*bytes) / 1e9, static_cast<double>(*bytes) / (1LL << 30),
                static_cast<double>(*bytes) / base, static_cast<long long>(*fit));
  }
}

} // namespace

int main(int argc, char** argv) {
  std::int64_t tokens = 8192;
  std::int64_t batch = 32;
  std::int32_t page_size = 16;
  double memory_gib = 80;
  const kvkit::model_config* model = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    if (a == "--model") {
      model = find_model(argv[i + 1]);
      if (model == nullptr) {
        std::fprintf(stderr, "unknown model '%s'\n", argv[i + 1]);
        return 2;
      }
    } else if (a == "--tokens") {
      tokens = std::atoll(argv[i + 1]);
    } else if (a == "--batch") {
      batch = std::atoll(argv[i + 1]);
    } else if (a == "--page-size") {
      page_size = std::atoi(argv[i + 1]);
    } else if (a == "--memory-gib") {
      memory_gib = std::atof(argv[i + 1]);
    } else {
      std::fprintf(stderr, "usage: kv_memory [--model NAME] [--tokens N] [--batch B] "
                           "[--page-size P] [--memory-gib G]\n");
      return 2;
    }
  }
  if (tokens < 0 || batch < 0 || page_size <= 0 || memory_gib < 0) {
    std::fprintf(stderr, "tokens, batch and memory must be >= 0, page size > 0\n");
    return 2;
  }

  // The worked numbers: 2 x layers x tokens x kv_heads x head_dim x bytes x batch.
  const double big = kvkit::kv_bytes(kvkit::models::llama3_70b, 8192, 32, 2.0);
  const double small = kvkit::kv_bytes(kvkit::models::llama3_8b, 4096, 8, 2.0);
  std::printf("Llama-3-70B, fp16, batch 32, 8192 tokens: 2 x 80 x 8192 x 8 x 128 x 2 B x 32 = "
              "%.1f GB\n",
              big / 1e9);
  std::printf("Llama-3-8B, fp16, batch 8, 4096 tokens:  2 x 32 x 4096 x 8 x 128 x 2 B x 8 = "
              "%.2f GiB\n",
              small / (1LL << 30));
  std::printf("(the table adds page rounding and per-page scales; tokens in memory: %.0f GiB)\n",
              memory_gib);

  if (model != nullptr) {
    table(*model, tokens, batch, page_size, memory_gib);
  } else {
    for (const auto& m : kvkit::models::all) {
      table(m, tokens, batch, page_size, memory_gib);
    }
  }
  return 0;
}
