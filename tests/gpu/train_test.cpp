// The GPU trainer: the models on the CUDA op table compute what they compute on the CPU (the
// reference), and `dptrain launch` trains gpt-tiny on one GPU in fp32, bf16 and fp16, with NCCL,
// to the CPU's held-out loss within a per-precision tolerance.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/model/gpt.hpp"
#include "core/model/mlp.hpp"
#include "tests/gpu/gpu_test.hpp"
#include "tests/harness.hpp"
#include "tests/model_check.hpp"
#include "tests/text_corpus.hpp"

namespace dptrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::Gradients;
using test::parse_json;
using test::random_windows;
using test::read_text;
using test::run_dptrain;
using test::run_model;
using test::source_dir;
using test::TempDir;
using test::tiny_gpt;
using test::write_recipe;
using test::write_text;

// How far a model's gradients computed with `dtype` activations may be from the f32 CPU's, relative
// to the largest CPU gradient (every element) and to the CPU gradients' norm (all of them). The
// gradients are small (the largest about 0.1, their RMS about 0.003), so the allowance must scale
// with them: a floor of 1 would pass zeros. 16-bit activations round every op's output (bf16 keeps
// 8 significant bits, 0.2% at most per rounding; f16 11 bits) and the sums run in f32, so the
// errors of a few layers' roundings add up to about 0.6% of the largest gradient in bf16 and 0.1%
// in f16 (the CPU's emulated 16-bit op table on these models and inputs), with room left for the
// GPU's own roundings (attention's tensor-core tiles); f32 differs only in summation orders and
// function approximations. Zeros are off by 100% of the largest gradient, sign flips by 200%.
double gradient_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 1e-3;
    case DType::bf16:
      return 3e-2;
    case DType::f16:
      return 1e-2;
  }
  return 0;
}

void compare(const Gradients& gpu, const Gradients& cpu, DType dtype, const char* what) {
  CAPTURE(what);
  CAPTURE(dtype_name(dtype));
  const double tol = gputest::tolerance(dtype);
  CHECK(gpu.loss == doctest::Approx(cpu.loss).epsilon(tol));
  CHECK(gpu.eval.loss_sum == doctest::Approx(cpu.eval.loss_sum).epsilon(tol));
  CHECK(gpu.eval.count == cpu.eval.count);
  REQUIRE(gputest::max_abs(cpu.grads) > 0);
  const double grad_tol = gradient_tolerance(dtype);
  gputest::check_close(gpu.grads, cpu.grads, grad_tol, std::string(what) + " gradients");
  gputest::check_norm_close(gpu.grads, cpu.grads, grad_tol, std::string(what) + " gradients");
}

}  // namespace

TEST_CASE("gpu: the GPT's loss and every gradient match the CPU's (f32, bf16, f16)") {
  const GptConfig c = tiny_gpt();
  Gpt cpu_model(c, std::make_shared<CpuOps>());
  std::vector<float> params(cpu_model.num_params());
  cpu_model.init_params(params, 7);
  const auto windows = random_windows(3, c.context + 1, c.vocab, 11);
  const Batch batch{nullptr, windows.data(), 3};
  CpuOps cpu_ops;
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    // The CPU computes from the parameters the device's 16-bit copy holds.
    const std::vector<float> rounded = gputest::rounded(params, dtype);
    const Gradients cpu = run_model(cpu_model, cpu_ops, rounded, batch);
    std::shared_ptr<Ops> gpu_ops = kernels::make_cuda_ops(0);
    Gpt gpu_model(c, gpu_ops, dtype);
    const Gradients gpu = run_model(gpu_model, *gpu_ops, params, batch);
    compare(gpu, cpu, dtype, "gpt");
  }
}

TEST_CASE("gpu: the MLP's loss and every gradient match the CPU's (f32, bf16)") {
  const std::vector<int64_t> widths = {20, 33, 17, 5};
  Mlp cpu_model(widths, Activation::gelu, std::make_shared<CpuOps>());
  std::vector<float> params(cpu_model.num_params());
  cpu_model.init_params(params, 3);
  const std::vector<float> x = gputest::random_vector(9 * 20, 5);
  std::vector<int32_t> y(9);
  for (size_t i = 0; i < y.size(); ++i)
    y[i] = static_cast<int32_t>(i % 5);
  CpuOps cpu_ops;
  for (DType dtype : {DType::f32, DType::bf16}) {
    std::vector<float> cpu_x = gputest::rounded(x, dtype);
    const Gradients cpu = run_model(cpu_model, cpu_ops, gputest::rounded(params, dtype),
                                    Batch{cpu_x.data(), y.data(), 9});
    std::shared_ptr<Ops> gpu_ops = kernels::make_cuda_ops(0);
    Mlp gpu_model(widths, Activation::gelu, gpu_ops, dtype);
    const Gradients gpu = run_model(gpu_model, *gpu_ops, params, Batch{x.data(), y.data(), 9});
    compare(gpu, cpu, dtype, "mlp");
  }
}

namespace {

// A small gpt on generated text, as the CPU tests train it.
struct GptRun {
  TempDir tmp;
  fs::path data = tmp / "dataset";
  GptRun() {
    write_text(tmp / "text.txt", test::synthetic_text(11, 200000));
    const auto r = run_dptrain(
        {"data", "prepare", "--text", (tmp / "text.txt").string(), "--out", data.string()});
    REQUIRE(r.exit_code == 0);
  }
  json recipe(const std::string& device, const std::string& precision) const {
    json r = parse_json(read_text(source_dir() / "recipes/gpt-tiny.json"));
    r["data"]["path"] = data.string();
    r["train"]["steps"] = 150;
    r["train"]["device"] = device;
    r["train"]["precision"] = precision;
    r["eval"]["max_samples"] = 256;
    return r;
  }
  // The launch's --json result.
  json train(const json& recipe, const std::string& name) const {
    const auto r = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "1",
                                "--run-dir", (tmp / name).string(), "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    return parse_json(r.out);
  }
};

}  // namespace

TEST_CASE("gpu: gpt-tiny trains on one GPU to the CPU's held-out loss, in every precision") {
  GptRun run;
  const json cpu = run.train(run.recipe("cpu", "fp32"), "cpu");
  const double cpu_loss = cpu["eval_loss"].get<double>();
  struct Case {
    std::string precision;  // not a const char*: doctest's MESSAGE would print its address
    double tolerance;       // relative, on the held-out loss after 150 steps
  };
  for (const Case& c : {Case{"fp32", 0.01}, Case{"bf16", 0.03}, Case{"fp16", 0.03}}) {
    CAPTURE(c.precision);
    const json gpu = run.train(run.recipe("cuda", c.precision), "cuda-" + c.precision);
    MESSAGE(c.precision << ": held-out loss " << gpu["eval_loss"] << " (CPU fp32 " << cpu_loss
                        << "), " << gpu["tokens_per_s"] << " tokens/s");
    CHECK(gpu["eval_loss"].get<double>() == doctest::Approx(cpu_loss).epsilon(c.tolerance));
  }
}

TEST_CASE("gpu: NCCL with one rank, a crash and a bit-exact resume from its checkpoint") {
  GptRun run;
  json recipe = run.recipe("cuda", "bf16");
  recipe["distributed"]["backend"] = "nccl";
  recipe["checkpoint"] = {{"every", 50}, {"keep", 3}};
  const json clean = run.train(recipe, "clean");
  CHECK(clean["eval_loss"].get<double>() < 3.0);
  const auto r =
      run_dptrain({"launch", write_recipe(run.tmp.path(), recipe).string(), "--nproc", "1",
                   "--run-dir", (run.tmp / "fault").string(), "--json", "--max-restarts", "1"},
                  {{"DPTRAIN_FAULT", "crash@step=70,rank=0,gen=1"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json resumed = parse_json(r.out);
  CHECK(resumed["restarts"] == 1);
  // Same kernels, same order, deterministic reductions: the same parameters.
  CHECK(resumed["params_checksum"] == clean["params_checksum"]);
}

}  // namespace dptrain
