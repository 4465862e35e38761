#include "../support.hpp"

#include <cstdlib>
#include <fstream>
#include <string>

#include <torch/csrc/jit/serialization/pickle.h>

#include "ddpkit/data.hpp"
#include "ddpkit/nn/models.hpp"
#include "ddpkit/testing.hpp"

using namespace ddpkit;

namespace {

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ddpkit::UsageError& e) {
    return e.what();
  }
  return "<no UsageError>";
}

}  // namespace

TEST_SUITE("nn") {
  TEST_CASE("ResNet parameter counts and names equal torchvision's") {
    CHECK(nn::count_parameters(*nn::resnet18(1000)) == 11689512);
    CHECK(nn::count_parameters(*nn::resnet34(5)) == 21287237);
    CHECK(nn::count_parameters(*nn::resnet50(1000)) == 25557032);
    auto net = nn::resnet34(5);
    auto sd = nn::state_dict(*net);
    for (const char* key :
         {"conv1.weight", "bn1.running_mean", "bn1.num_batches_tracked",
          "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
          "layer2.0.downsample.1.running_var", "layer4.2.bn2.bias", "fc.weight",
          "fc.bias"}) {
      CAPTURE(key);
      CHECK(sd.contains(key));
    }
    CHECK_FALSE(sd.contains("layer1.0.downsample.0.weight"));
    CHECK(sd.size() == 218);  // torchvision resnet34: 218 state-dict entries
    // Kaiming fan_out: std = sqrt(2 / (out * k * k)).
    auto w = net->layer3->named_parameters()["0.conv1.weight"];
    CHECK(std::abs(w.std().item<double>() - std::sqrt(2.0 / (256 * 9))) <
          0.002);
  }

  TEST_CASE("model output shapes and clone") {
    torch::NoGradGuard g;
    auto x = torch::randn({1, 3, 64, 64});
    auto r18 = nn::resnet18(7);
    r18->eval();
    CHECK(r18->forward(x).sizes() == torch::IntArrayRef({1, 7}));
    auto r50 = nn::resnet50(3);
    r50->eval();
    CHECK(r50->forward(x).sizes() == torch::IntArrayRef({1, 3}));
    auto copy = std::dynamic_pointer_cast<nn::ResNetImpl>(r18->clone());
    REQUIRE(copy);
    CHECK(torch::equal(copy->forward(x), r18->forward(x)));
    // Each block is a ZeRO-3 unit, the clone's own blocks too (forward
    // calls the blocks through the list of units).
    for (auto* net : {r18.get(), copy.get()}) {
      for (auto* layer : {&net->layer1, &net->layer4}) {
        for (const auto& block : (*layer)->children()) {
          CHECK(nn::is_unit(*block));
        }
      }
    }
    nn::CifarNet cifar;
    CHECK(nn::is_unit(*cifar->features.ptr()));
    CHECK(nn::is_unit(*cifar->classifier.ptr()));
    nn::CifarNet net(nn::CifarNetOptions(10));
    net->eval();
    CHECK(net->forward(torch::randn({2, 3, 32, 32})).sizes() ==
          torch::IntArrayRef({2, 10}));
    CHECK(nn::count_parameters(*net) == 620586);
  }

  TEST_CASE("CifarNet learns the synthetic set within a few epochs") {
    torch::manual_seed(0);
    auto train =
        testing::make_synthetic(testing::SyntheticOptions(1500).seed(1));
    auto test = testing::make_synthetic(testing::SyntheticOptions(500).seed(2));
    nn::CifarNet net;
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(2e-3));
    data::Loader loader(train, data::CifarTrain{},
                        data::LoaderOptions(50).workers(1));
    data::RandomSampling sampler(train.size(), {.seed = 3});
    for (size_t epoch = 0; epoch < 3; ++epoch) {
      net->train();
      sampler.set_epoch(epoch);
      for (data::Batch b : loader.epoch(sampler.indices(), epoch)) {
        opt.zero_grad();
        auto loss = torch::cross_entropy_loss(net->forward(b.data), b.target);
        loss.backward();
        opt.step();
      }
    }
    net->eval();
    torch::NoGradGuard g;
    auto gen = data::make_generator(0);
    auto pred = net->forward(data::CifarEval{}(test.images, gen)).argmax(1);
    double acc = pred.eq(test.labels).to(torch::kDouble).mean().item<double>();
    MESSAGE("CifarNet synthetic accuracy after 3 epochs: " << acc);
    CHECK(acc > 0.5);
  }

  TEST_CASE("state dict save/load and transfer learning") {
    ddpkit::test::TempDir tmp;
    auto a = nn::resnet18(5);
    nn::save_state_dict(*a, tmp / "a.pt");
    auto b = nn::resnet18(5);
    auto report = nn::load_state_dict(*b, tmp / "a.pt");
    CHECK(report.loaded.size() == 122);
    CHECK(torch::equal(b->fc->weight, a->fc->weight));

    auto c = nn::resnet18(10);
    CHECK(what_of([&] {
            nn::load_state_dict(*c, tmp / "a.pt");
          }).find("fc.weight") != std::string::npos);
    auto r = nn::load_state_dict(
        *c, tmp / "a.pt", nn::LoadStateDictOptions().skip_mismatched(true));
    CHECK(r.skipped_shape == std::vector<std::string>{"fc.weight", "fc.bias"});
    CHECK(torch::equal(c->conv1->weight, a->conv1->weight));

    auto small = nn::CifarNet();
    auto msg = what_of([&] { nn::load_state_dict(*small, tmp / "a.pt"); });
    CHECK(msg.find("missing [features.0.weight") != std::string::npos);
    auto r2 = nn::load_state_dict(*small, tmp / "a.pt",
                                  nn::LoadStateDictOptions().strict(false));
    CHECK(r2.loaded.empty());
    CHECK(r2.unexpected.size() == 122);

    std::ofstream(tmp / "junk.pth") << "not a checkpoint";
    CHECK(what_of([&] {
            nn::read_state_dict(tmp / "junk.pth");
          }).find("torch.save(torch.load(") != std::string::npos);
  }

  TEST_CASE(
      "damaged state dict files are UsageErrors, not out-of-bounds reads") {
    // Found by fuzzing (tests/fuzz). libtorch 1.13 takes a pickled tensor's
    // storage offset on trust, and its in-memory zip reader (used by
    // torch::pickle_load) reads wherever the zip's offsets point.
    ddpkit::test::TempDir tmp;
    torch::nn::Linear lin(4, 3);
    nn::save_state_dict(*lin, tmp / "good.pt");
    const auto good = ddpkit::test::file_bytes(tmp / "good.pt");
    CHECK(nn::read_state_dict(tmp / "good.pt").size() == 2);

    auto bytes = good;
    REQUIRE(ddpkit::test::set_pickled_storage_offset(bytes, "weight", 200));
    ddpkit::test::write_file_bytes(tmp / "offset.pt", bytes);
    // The CRC-32 of the changed entry catches each of these first ...
    CHECK(what_of([&] {
            nn::read_state_dict(tmp / "offset.pt");
          }).find("do not match its checksum") != std::string::npos);
    // ... and the checks behind it catch them where there is none.
    ddpkit::test::WithoutZipChecksums no_crc;
    auto msg = what_of([&] { nn::read_state_dict(tmp / "offset.pt"); });
    CHECK(msg.find("offset.pt: cannot be read as a torch.save file: a tensor "
                   "that reaches past its storage") != std::string::npos);

    // A string length far past the end: libtorch allocated it all first.
    bytes = good;
    const auto at = ddpkit::test::find_pickled_string(bytes, "weight");
    REQUIRE(at != std::string::npos);
    bytes[at + 4] = 0x60;
    ddpkit::test::write_file_bytes(tmp / "length.pt", bytes);
    msg = what_of([&] { nn::read_state_dict(tmp / "length.pt"); });
    CHECK(msg.find("runs past the end") != std::string::npos);

    // No end-of-central-directory record.
    bytes = good;
    const auto eocd = bytes.rfind("PK\x05\x06");
    REQUIRE(eocd != std::string::npos);
    bytes[eocd + 3] = 0x07;
    ddpkit::test::write_file_bytes(tmp / "eocd.pt", bytes);
    msg = what_of([&] { nn::read_state_dict(tmp / "eocd.pt"); });
    CHECK(msg.find("eocd.pt cannot be read") != std::string::npos);
  }

  TEST_CASE("state dicts interoperate with torchvision") {
    ddpkit::test::TempDir tmp;
    torch::manual_seed(1);
    auto net = nn::resnet34(5);
    {
      // Move the BN running statistics off their defaults first.
      torch::NoGradGuard g;
      net->train();
      for (int i = 0; i < 2; ++i)
        net->forward(torch::randn({2, 3, 64, 64}) * 2 + 0.5);
    }
    net->eval();
    auto x = torch::randn({1, 3, 64, 64});
    torch::Tensor y;
    {
      torch::NoGradGuard g;
      y = net->forward(x);
    }
    nn::save_state_dict(*net, tmp / "ddpkit_r34.pt");
    ddpkit::test::save_tensors(tmp / "io.pt", {{"x", x}, {"y", y}});
    const int rc = ddpkit::test::run_python_check(tmp.path(), R"PY(
import sys, torch, torchvision
d = sys.argv[1]
# Default torch.load: weights_only=True since PyTorch 2.6.
io = torch.load(d + "/io.pt")
sd = torch.load(d + "/ddpkit_r34.pt")
assert isinstance(sd, dict), type(sd)
m = torchvision.models.resnet34(num_classes=5)
ref = m.state_dict()
assert list(sd.keys()) == list(ref.keys()), (list(sd), list(ref))
for k in ref: assert sd[k].shape == ref[k].shape, k
m.load_state_dict(sd)
m.eval()
with torch.no_grad():
    y = m(io["x"])
err = (y - io["y"]).abs().max().item()
print("ddpkit->torchvision max |dlogit| =", err)
assert err < 1e-4, err
# The everyday way: torch.save(model.state_dict()) -- an OrderedDict --
# of torchvision's own resnet34 layout, and of a resnet18.
torch.manual_seed(0)
t = torchvision.models.resnet34(num_classes=1000)
r = torchvision.models.resnet18(num_classes=7)
with torch.no_grad():
    for net in (t, r):
        net.train(); net(torch.randn(2, 3, 64, 64)); net.eval()
    ty = t(io["x"])
    ry = r(io["x"])
torch.save(t.state_dict(), d + "/tv_r34.pt")
torch.save(r.state_dict(), d + "/tv_r18.pt")
torch.save({"r34": ty, "r18": ry}, d + "/tv_out.pt")
# A one-entry plain dict pickles with SETITEM (libtorch 1.13's unpickler lacked it).
torch.save({"only": ry}, d + "/one.pt")
torch.save(dict(r.state_dict()), d + "/legacy.pth", _use_new_zipfile_serialization=False)
)PY",
                                                  tmp.str());
    if (rc == -1) return;  // no Python outside CI: skipped, loudly
    REQUIRE(rc == 0);

    torch::NoGradGuard g;
    const auto out = nn::read_state_dict(tmp / "tv_out.pt");
    auto r34 = nn::resnet34(1000);
    auto report = nn::load_state_dict(*r34, tmp / "tv_r34.pt");
    CHECK(report.loaded.size() == 218);
    r34->eval();
    CHECK(torch::allclose(r34->forward(x), out.at("r34"), 1e-4, 1e-4));
    auto r18 = nn::resnet18(7);
    CHECK(nn::load_state_dict(*r18, tmp / "tv_r18.pt").loaded.size() == 122);
    r18->eval();
    CHECK(torch::allclose(r18->forward(x), out.at("r18"), 1e-4, 1e-4));
    CHECK(torch::equal(nn::read_state_dict(tmp / "one.pt").at("only"),
                       out.at("r18")));

    auto legacy = what_of([&] { nn::read_state_dict(tmp / "legacy.pth"); });
    CHECK(legacy.find("legacy") != std::string::npos);
    CHECK(legacy.find("python3 -c") != std::string::npos);
  }

}  // TEST_SUITE("nn")
