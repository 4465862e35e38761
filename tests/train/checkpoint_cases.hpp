// Checkpoints and resume (include/ddpkit/train/checkpoint_connector.hpp and
// checkpoint.hpp): cases of the "train" suite, included by
// tests/train/trainer_test.cpp, whose workers and helpers they use (one
// translation unit).
#pragma once

TEST_SUITE("train") {
  TEST_CASE(
      "resume: 4 epochs equal 2 epochs + resume + 2 epochs, bit for bit") {
    auto d = make_data(64, 20);
    auto run = [&](const fs::path& out, int epochs, const std::string& resume) {
      torch::manual_seed(3);
      SingleDeviceTrainer<TinyNet> trainer(
          TinyNet(), adam(),
          base_options(out, epochs).resume(resume).verbose(false));
      return trainer.fit(d.train, d.val, data::CifarTrain{}, data::CifarEval{},
                         data::LoaderOptions(16).workers(2));
    };
    TempDir a, b;
    auto full = run(a.path(), 4, "");
    run(b.path(), 2, "");
    // A different seed for the fresh model proves the weights come from the
    // file.
    torch::manual_seed(99);
    auto resumed = run(b.path(), 4, "auto");
    REQUIRE(resumed.history.size() == 4);
    CHECK(full.history.back().value("val_acc") ==
          resumed.history.back().value("val_acc"));
    CHECK(full.history.back().train_loss() ==
          resumed.history.back().train_loss());
    auto ma = model_of(a / "checkpoints/last.pt"),
         mb = model_of(b / "checkpoints/last.pt");
    REQUIRE(ma.size() == mb.size());
    for (auto& kv : ma) {
      CAPTURE(kv.key().toStringRef());
      CHECK(torch::equal(kv.value().toTensor(), mb.at(kv.key()).toTensor()));
    }
    CHECK(count_of(read_file(b / "metrics.jsonl"), "\"epoch\":") == 4);
  }

  TEST_CASE(
      "resume without a shared filesystem: rank 0's checkpoint alone resumes "
      "every rank, bit for bit; another seed is refused and the checkpoint "
      "kept, unless allowed") {
    auto run = [](const TempDir& dir, const std::string& tag, int epochs,
                  const std::string& resume, int seed, bool allow) {
      return run_workers("trainer_resume_local", 2, dir.str(),
                         {{"T_TAG", tag},
                          {"T_EPOCHS", std::to_string(epochs)},
                          {"T_RESUME", resume},
                          {"T_SEED", std::to_string(seed)},
                          {"T_ALLOW", allow ? "1" : "0"}});
    };
    TempDir a, b;
    REQUIRE(run(a, "full", 4, "", 7, false).ok());
    REQUIRE(run(b, "first", 2, "", 7, false).ok());
    CHECK(!fs::exists(b / "out1" / "checkpoints"));  // rank 1 writes none
    REQUIRE(run(b, "resumed", 4, "auto", 7, false).ok());
    const auto log0 = read_file(b / "stdout-resumed0");
    CAPTURE(log0);
    CHECK(log0.find("resumed from " +
                    (b / "out0/checkpoints/last.pt").string() +
                    " after epoch 2") != std::string::npos);
    auto ma = model_of(a / "out0/checkpoints/last.pt"),
         mb = model_of(b / "out0/checkpoints/last.pt");
    REQUIRE(ma.size() == mb.size());
    for (auto& kv : ma) {
      CAPTURE(kv.key().toStringRef());
      CHECK(torch::equal(kv.value().toTensor(), mb.at(kv.key()).toTensor()));
    }
    CHECK(count_of(read_file(b / "out0" / "metrics.jsonl"), "\"epoch\":") == 4);

    // Another seed: refused on every rank, before anything is written.
    const auto last = b / "out0/checkpoints/last.pt";
    const auto before = read_file(last);
    auto res = run(b, "seed", 6, "auto", 8, false);
    CHECK(res.exit_code == 7);
    for (int r = 0; r < 2; ++r) {
      const auto msg = read_file(b / ("error" + std::to_string(r)));
      CAPTURE(msg);
      CHECK(msg.find("was written by a run with other settings: seed 7 -> 8") !=
            std::string::npos);
      CHECK(msg.find("--resume-allow-changes") != std::string::npos);
    }
    CHECK(read_file(last) == before);
    // Allowed: resumes, saying what changes.
    REQUIRE(run(b, "allowed", 5, "auto", 8, true).ok());
    CHECK(read_file(b / "stdout-allowed0")
              .find("with changed settings: seed 7 -> 8") != std::string::npos);
    CHECK(count_of(read_file(b / "out0" / "metrics.jsonl"), "\"epoch\":") == 5);
  }

  TEST_CASE(
      "mid-epoch checkpoints: DDP at world 2 stopped after batch 7 resumes at "
      "batch 7 of epoch 2 and ends with an uninterrupted run's weights, bit "
      "for bit") {
    auto run = [](const TempDir& dir, const std::string& tag, int stop_at,
                  const std::string& resume) {
      return run_workers("trainer_mid_epoch", 2, dir.str(),
                         {{"T_TAG", tag},
                          {"T_STOP_AT", std::to_string(stop_at)},
                          {"T_RESUME", resume}});
    };
    TempDir a, b;
    REQUIRE(run(a, "full", 0, "").ok());
    // Checkpoints after batches 3 (epoch 1), 4 (its end) and 6 (epoch 2,
    // batch 2); the failure comes after batch 7.
    auto res = run(b, "stopped", 7, "");
    CHECK(res.exit_code == 3);
    {
      auto archive = train::open_checkpoint(b / "out/checkpoints/last.pt");
      c10::IValue done, epochs;
      archive.read("epoch_batches_done", done);
      archive.read("epochs_done", epochs);
      CHECK(done.toInt() == 2);
      CHECK(epochs.toInt() == 1);
    }
    REQUIRE(run(b, "resumed", 0, "auto").ok());
    CHECK(read_file(b / "stdout-resumed0")
              .find("continuing epoch 2 at batch 3") != std::string::npos);
    auto ma = model_of(a / "out/checkpoints/last.pt"),
         mb = model_of(b / "out/checkpoints/last.pt");
    REQUIRE(ma.size() == mb.size());
    for (auto& kv : ma) {
      CAPTURE(kv.key().toStringRef());
      CHECK(torch::equal(kv.value().toTensor(), mb.at(kv.key()).toTensor()));
    }
    // The resumed epoch's training metrics count every batch once.
    auto rows = [](const fs::path& f) {
      std::vector<std::string> r;
      std::istringstream in(read_file(f));
      for (std::string line; std::getline(in, line);) {
        r.push_back(line.substr(0, line.find(",\"lr\"")));
      }
      return r;
    };
    const auto ra = rows(a / "out/metrics.jsonl"),
               rb = rows(b / "out/metrics.jsonl");
    REQUIRE(ra.size() == 3);
    REQUIRE(rb.size() == 3);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(ra[i]);
      CAPTURE(rb[i]);
      auto num = [](const std::string& row, const std::string& k) {
        return std::stod(row.substr(row.find("\"" + k + "\":") + k.size() + 3));
      };
      for (const char* k : {"train_loss", "train_acc", "val_loss", "val_acc"}) {
        CHECK(num(ra[i], k) == doctest::Approx(num(rb[i], k)).epsilon(1e-12));
      }
    }
    // Throughput of the resumed epoch counts the 32 images trained after
    // the checkpoint (2 ranks x 2 batches of 8), not the 64 of the epoch.
    const auto full_rows = read_file(b / "out/metrics.jsonl");
    std::istringstream in(full_rows);
    std::string row;
    for (int i = 0; i < 2; ++i) std::getline(in, row);
    auto num = [&](const std::string& k) {
      return std::stod(row.substr(row.find("\"" + k + "\":") + k.size() + 3));
    };
    CHECK(num("train_images_per_second") * num("train_seconds") ==
          doctest::Approx(32).epsilon(1e-6));
  }

  TEST_CASE(
      "SIGTERM to one rank mid-epoch: DDP at world 2 stops both ranks at the "
      "same batch after a checkpoint there, and the resumed run ends with an "
      "uninterrupted run's weights, bit for bit") {
    auto run = [](const TempDir& dir, const std::string& tag, int signal_at,
                  const std::string& resume) {
      return run_workers("trainer_mid_epoch", 2, dir.str(),
                         {{"T_TAG", tag},
                          {"T_STOP_AT", "0"},
                          {"T_EVERY", "0"},
                          {"T_SIGNAL_AT", std::to_string(signal_at)},
                          {"T_RESUME", resume}});
    };
    TempDir a;
    REQUIRE(run(a, "full", 0, "").ok());
    const auto want = model_of(a / "out/checkpoints/last.pt");
    // Raised after batch 5 and 7, seen at the next step's agreement: stops
    // after batch 6 (epoch 2, batch 2 of 4), and after the last batch of
    // epoch 2 (before its evaluation).
    for (int signal_at : {5, 7}) {
      CAPTURE(signal_at);
      TempDir b;
      auto res = run(b, "stopped", signal_at, "");
      CHECK(res.exit_code == 4);
      const std::string where = signal_at == 5
                                    ? "after batch 2 of 4 in epoch 2"
                                    : "after batch 4 of 4 in epoch 2";
      for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        const auto msg = read_file(b / ("interrupted" + std::to_string(r)));
        MESSAGE(msg);
        CHECK(
            msg.rfind(std::to_string(SIGTERM) + " stopped by SIGTERM " + where,
                      0) == 0);
        CHECK(msg.find("--resume auto") != std::string::npos);
      }
      {
        auto archive = train::open_checkpoint(b / "out/checkpoints/last.pt");
        c10::IValue done, epochs;
        archive.read("epoch_batches_done", done);
        archive.read("epochs_done", epochs);
        CHECK(done.toInt() == (signal_at == 5 ? 2 : 4));
        CHECK(epochs.toInt() == 1);
      }
      REQUIRE(run(b, "resumed", 0, "auto").ok());
      auto got = model_of(b / "out/checkpoints/last.pt");
      REQUIRE(got.size() == want.size());
      for (auto& kv : want) {
        CAPTURE(kv.key().toStringRef());
        CHECK(torch::equal(kv.value().toTensor(), got.at(kv.key()).toTensor()));
      }
      CHECK(count_of(read_file(b / "out/metrics.jsonl"), "\"epoch\":") == 3);
    }
  }

  TEST_CASE(
      "keep_best: the k best epochs by the chosen metric, best.pt the first, "
      "the same set after a resume") {
    auto d = make_data(64, 20);
    auto run = [&](const fs::path& out, int epochs, const std::string& resume,
                   int k, const std::string& metric) {
      torch::manual_seed(3);
      SingleDeviceTrainer<TinyNet> trainer(TinyNet(), adam(),
                                           base_options(out, epochs)
                                               .resume(resume)
                                               .verbose(false)
                                               .tensorboard(false)
                                               .keep_best(k)
                                               .monitor(metric));
      return trainer.fit(d.train, d.val, data::CifarTrain{}, data::CifarEval{},
                         data::LoaderOptions(16).workers(0));
    };
    auto kept = [](const fs::path& out) {
      std::set<std::string> names;
      for (auto& e : fs::directory_iterator(out / "checkpoints")) {
        names.insert(e.path().filename().string());
      }
      return names;
    };
    auto epochs_done = [](const fs::path& f) {
      c10::IValue v;
      train::open_checkpoint(f).read("epochs_done", v);
      return v.toInt();
    };
    TempDir a;
    auto r = run(a.path(), 6, "", 3, "val_loss");
    std::vector<std::pair<double, int>> by_loss;
    std::string losses;
    for (const auto& m : r.history) {
      by_loss.emplace_back(m.val_loss(), m.epoch);
      losses += " " + std::to_string(m.val_loss());
    }
    std::stable_sort(by_loss.begin(), by_loss.end(),
                     [](auto& x, auto& y) { return x.first < y.first; });
    MESSAGE("val_loss by epoch:", losses);
    std::set<std::string> want = {"last.pt", "last-prev.pt", "best.pt"};
    for (int i = 0; i < 3; ++i) {
      want.insert("best-epoch-" + std::to_string(by_loss[i].second) + ".pt");
    }
    const auto files = kept(a.path());
    CHECK(files == want);
    for (int i = 0; i < 3; ++i) {
      const int e = by_loss[i].second;
      CHECK(epochs_done(a / "checkpoints" /
                        ("best-epoch-" + std::to_string(e) + ".pt")) == e);
    }
    const auto first =
        a / "checkpoints" /
        ("best-epoch-" + std::to_string(by_loss[0].second) + ".pt");
    CHECK(fs::equivalent(a / "checkpoints" / "best.pt", first));
    CHECK(epochs_done(a / "checkpoints" / "best.pt") == by_loss[0].second);

    // Interrupted after 3 epochs and resumed: the same files, same bytes.
    TempDir b;
    run(b.path(), 3, "", 3, "val_loss");
    run(b.path(), 6, "auto", 3, "val_loss");
    CHECK(kept(b.path()) == want);
    for (const auto& name : want) {
      if (name == "last.pt") continue;
      CAPTURE(name);
      auto ma = model_of(a / "checkpoints" / name),
           mb = model_of(b / "checkpoints" / name);
      for (auto& kv : ma) {
        CHECK(torch::equal(kv.value().toTensor(), mb.at(kv.key()).toTensor()));
      }
    }

    // The default (1, val_acc): best.pt alone, from the first epoch with the
    // highest val_acc.
    TempDir c;
    auto rc = run(c.path(), 4, "", 1, "val_acc");
    CHECK(kept(c.path()) ==
          std::set<std::string>{"last.pt", "last-prev.pt", "best.pt"});
    CHECK(epochs_done(c / "checkpoints" / "best.pt") == rc.best_epoch);
  }

  TEST_CASE(
      "checkpoints: a crash between write and rename keeps the old file") {
    TempDir dir;
    auto path = dir / "last.pt";
    train::Checkpoint first;
    first.write("v", torch::tensor({1.0}));
    train::atomic_save(first, path);
    train::Checkpoint second;
    second.write("v", torch::tensor({2.0}));
    train::before_rename_hook() = [] {
      throw std::runtime_error("simulated crash");
    };
    CHECK_THROWS_WITH(train::atomic_save(second, path), "simulated crash");
    train::before_rename_hook() = nullptr;
    auto archive = train::open_checkpoint(path);
    torch::Tensor v;
    archive.read("v", v);
    CHECK(v.item<double>() == 1.0);
  }

  TEST_CASE("checkpoints: bad files are clear errors naming the file and key") {
    TempDir dir;
    auto bad = dir / "truncated.pt";
    std::ofstream(bad) << "PK\x03\x04 not really a zip";
    CHECK_THROWS_WITH_AS(train::open_checkpoint(bad),
                         doctest::Contains("truncated.pt cannot be read"),
                         UsageError);
    CHECK_THROWS_WITH_AS(train::open_checkpoint(dir / "missing.pt"),
                         doctest::Contains("missing.pt does not exist"),
                         UsageError);
    // A checkpoint of another model.
    train::Checkpoint other;
    torch::nn::Linear lin(3, 4);
    other.write("model", c10::IValue(nn::state_dict(*lin)));
    train::atomic_save(other, dir / "other.pt");
    auto archive = train::open_checkpoint(dir / "other.pt");
    TinyNet net;
    CHECK_THROWS_WITH_AS(
        train::load_module_checked(*net, archive, "model", dir / "other.pt"),
        doctest::Contains("key 'conv.weight' is missing"), UsageError);
    // Same names, other shapes.
    train::Checkpoint shapes;
    auto sd = nn::state_dict(*net);
    sd.insert_or_assign("fc.weight", torch::zeros({5, 8}));
    shapes.write("model", c10::IValue(sd));
    train::atomic_save(shapes, dir / "shapes.pt");
    auto a2 = train::open_checkpoint(dir / "shapes.pt");
    CHECK_THROWS_WITH_AS(
        train::load_module_checked(*net, a2, "model", dir / "shapes.pt"),
        doctest::Contains(
            "key 'fc.weight' has shape [5, 8] but the model expects [10, 8]"),
        UsageError);
  }

  TEST_CASE("checkpoints: damaged archives are refused before libtorch") {
    // Found by fuzzing (tests/fuzz): a damaged archive made libtorch crash
    // compiling its code entries, allocate gigabytes from a length field,
    // or hand over tensors whose elements lie outside their storage.
    TempDir dir;
    TinyNet net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    train::Checkpoint a;
    a.write("model", c10::IValue(nn::state_dict(*net)));
    a.write_optimizer(sgd);
    train::atomic_save(a, dir / "good.pt");
    const auto good = test::file_bytes(dir / "good.pt");
    auto archive = train::open_checkpoint(dir / "good.pt");
    train::load_module_checked(*net, archive, "model", dir / "good.pt");

    auto refused = [&](const std::string& name, const std::string& bytes) {
      test::write_file_bytes(dir / name, bytes);
      try {
        auto ar = train::open_checkpoint(dir / name);
        train::load_module_checked(*net, ar, "model", dir / name);
        train::load_optimizer_checked(sgd, ar, dir / name);
      } catch (const UsageError& e) {
        return std::string(e.what());
      }
      return std::string("<no UsageError>");
    };
    auto bytes = good;
    REQUIRE(test::set_pickled_storage_offset(bytes, "fc.weight", 200));
    // The CRC-32 of the changed entry catches each of these first; the
    // checks behind it catch them where there is none.
    CHECK(refused("offset.pt", bytes).find("do not match its checksum") !=
          std::string::npos);
    test::WithoutZipChecksums no_crc;
    auto msg = refused("offset.pt", bytes);
    CHECK(msg.find("offset.pt: cannot be read as a torch.save file: a tensor "
                   "that reaches past its storage") != std::string::npos);

    bytes = good;
    const auto code = bytes.find("class Module(Module):\n  __parameters__");
    REQUIRE(code != std::string::npos);
    bytes.replace(code + 24, 14, "_pamar_eters__");
    // (the optimizer state is libtorch's own archive, with code entries)
    msg = refused("code.pt", bytes);
    CHECK(msg.find("code.pt: optimizer state cannot be read") !=
          std::string::npos);
    CHECK(msg.find("line 2 is not an attribute declaration") !=
          std::string::npos);

    bytes = good;
    const auto at = test::find_pickled_string(bytes, "fc.weight");
    REQUIRE(at != std::string::npos);
    bytes[at + 4] = 0x60;
    msg = refused("length.pt", bytes);
    CHECK(msg.find("runs past the end") != std::string::npos);
  }

  TEST_CASE("checkpoints: resume state and optimizer errors name the file") {
    TempDir dir;
    TinyNet net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    train::Checkpoint a;
    a.write_optimizer(sgd);
    a.write("epochs_done", torch::tensor({std::nan("")}, torch::kFloat64));
    a.write("history", torch::zeros({2, 3}, torch::kFloat64));
    train::atomic_save(a, dir / "bad.pt");
    auto archive = train::open_checkpoint(dir / "bad.pt");
    CHECK_THROWS_WITH_AS(
        train::TrainingState::load(archive, dir / "bad.pt", kColumns, 3),
        doctest::Contains("'epochs_done' is nan, not a whole "
                          "number"),
        UsageError);
    // An optimizer of another model (two parameters, not six).
    torch::nn::Linear other(3, 2);
    torch::optim::SGD other_sgd(other->parameters(),
                                torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH_AS(
        train::load_optimizer_checked(other_sgd, archive, dir / "bad.pt"),
        doctest::Contains("bad.pt: optimizer state does not fit"), UsageError);

    train::Checkpoint b;
    for (const char* k : {"epochs_done", "best_val_acc", "best_epoch",
                          "bad_epochs", "loss_scale"}) {
      b.write(k, torch::tensor({1.0}, torch::kFloat64));
    }
    b.write("history", torch::zeros({2, 3}, torch::kFloat64));
    train::atomic_save(b, dir / "history.pt");
    auto hist = train::open_checkpoint(dir / "history.pt");
    // EpochMetrics::from_tensor read 8 columns of what had 3.
    CHECK_THROWS_WITH_AS(
        train::TrainingState::load(hist, dir / "history.pt", kColumns, 3),
        doctest::Contains("'history' is not an N x 11 (or, "
                          "from format version 2, N x 8) "
                          "table"),
        UsageError);

    // A format-2 history (8 columns, whole-epoch images/s in the last)
    // still resumes; the train/val split it never had is NaN.
    b.write("history", torch::arange(16, torch::kFloat64).reshape({2, 8}));
    train::atomic_save(b, dir / "v2.pt");
    auto v2 = train::TrainingState::load(train::open_checkpoint(dir / "v2.pt"),
                                         dir / "v2.pt", kColumns, 3);
    REQUIRE(v2.history.size() == 2);
    CHECK(v2.history[1].epoch == 8);
    CHECK(v2.history[1].seconds == 14);
    CHECK(v2.history[1].epoch_images_per_second == 15);
    CHECK(std::isnan(v2.history[1].train_seconds));
    CHECK(std::isnan(v2.history[1].train_images_per_second));
    CHECK(train::to_json(v2.history[1]).find("\"train_seconds\":null") !=
          std::string::npos);
  }

  TEST_CASE(
      "asynchronous checkpoint: the file holds the snapshot, not an update "
      "made right after it (pytorch#144657); a background error is rethrown "
      "on the training thread") {
    TempDir out;
    torch::manual_seed(1);
    torch::nn::Linear lin(512, 512);
    torch::NoGradGuard no_grad;
    const torch::Tensor before = lin->weight.clone();
    train::Checkpoint archive;
    archive.write("model", c10::IValue(nn::state_dict(*lin)));
    {
      train::CheckpointQueue queue(/*asynchronous=*/true);
      queue.write(train::checkpoint_snapshot(archive), out / "a.pt", {});
      queue.launch();
      lin->weight.add_(1.0);  // the next step's update, at once
      queue.wait();
    }
    CHECK(torch::equal(model_of(out / "a.pt").at("weight").toTensor(), before));
    train::CheckpointQueue queue(/*asynchronous=*/true);
    queue.then([] { throw IoError("cannot write x.pt: No space left"); });
    CHECK_NOTHROW(queue.launch());
    CHECK_THROWS_WITH_AS(queue.wait(), doctest::Contains("No space left"),
                         IoError);
  }

  TEST_CASE(
      "asynchronous checkpoint: the optimizer's state is copied, not "
      "serialised, while training waits, and the file holds the snapshot's "
      "state, not a step made right after it") {
    TempDir out;
    torch::manual_seed(2);
    torch::nn::Linear lin(64, 64);
    auto step = [&](torch::optim::Optimizer& opt) {
      opt.zero_grad();
      lin(torch::randn({8, 64})).square().mean().backward();
      opt.step();
    };
    // The state each optimizer holds at the snapshot, as bytes made then,
    // and as the file holds it after one more step; loaded into fresh
    // optimizers of the same type and compared entry by entry.
    auto check =
        [&](torch::optim::Optimizer& opt,
            std::function<std::unique_ptr<torch::optim::Optimizer>()> fresh) {
          step(opt);
          step(opt);
          const torch::Tensor at_snapshot = train::optimizer_bytes(opt);
          train::Checkpoint archive;
          archive.write_later("optimizer",
                              [make = train::optimizer_snapshot(opt)] {
                                return c10::IValue(make());
                              });
          train::CheckpointQueue queue(/*asynchronous=*/true);
          queue.write(train::checkpoint_snapshot(archive), out / "o.pt", {});
          queue.launch();
          step(opt);  // the next step, at once
          queue.wait();
          auto file = train::open_checkpoint(out / "o.pt");
          auto expected = fresh(), saved = fresh();
          train::Checkpoint then;
          then.write("optimizer", at_snapshot);
          train::load_optimizer_checked(*expected, then, "then");
          train::load_optimizer_checked(*saved, file, out / "o.pt");
          REQUIRE(saved->state().size() == expected->state().size());
          REQUIRE(saved->state().size() == 2);
          for (const auto& p : lin->parameters()) {
            const auto key = ddpkit::compat::optimizer_state_key(p);
            const auto &a = *saved->state().at(key),
                       &b = *expected->state().at(key);
            torch::serialize::OutputArchive x, y;
            a.serialize(x);
            b.serialize(y);
            std::ostringstream xs, ys;
            x.save_to(xs);
            y.save_to(ys);
            CHECK(xs.str() == ys.str());  // the snapshot's state, bit for bit
            // ... which the step after it changed.
            torch::serialize::OutputArchive z;
            opt.state().at(key)->serialize(z);
            std::ostringstream zs;
            z.save_to(zs);
            CHECK(zs.str() != xs.str());
          }
        };
    torch::optim::SGD sgd(lin->parameters(),
                          torch::optim::SGDOptions(0.1).momentum(0.9));
    check(sgd, [&] {
      return std::make_unique<torch::optim::SGD>(
          lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    });
    parallel::ForeachAdamW adamw(lin->parameters(),
                                 torch::optim::AdamWOptions(1e-2));
    check(adamw, [&] {
      return std::make_unique<torch::optim::AdamW>(
          lin->parameters(), torch::optim::AdamWOptions(1e-2));
    });
  }

  TEST_CASE(
      "checkpoints: a non-finite buffer is refused, naming it, and the "
      "previous last.pt stays; asynchronous checkpoints check in the "
      "background") {
    auto d = make_data(64, 20);
    for (const bool async : {false, true}) {
      CAPTURE(async);
      TempDir out;
      torch::manual_seed(3);
      // 4 batches an epoch: the odometer turns NaN in epoch 2.
      SingleDeviceTrainer<OdometerNet> trainer(
          OdometerNet(6), adam(),
          base_options(out.path(), 3).async_checkpoints(async).verbose(false));
      CHECK_THROWS_WITH_AS(
          trainer.fit(d.train, d.val, data::CifarTrain{}, data::CifarEval{},
                      data::LoaderOptions(16).workers(0)),
          doctest::Contains("last.pt: buffer 'odometer' holds non-finite "
                            "values"),
          NonFiniteError);
      const auto last = out / "checkpoints" / "last.pt";
      auto archive = train::open_checkpoint(last);
      const auto state = train::TrainingState::load(
          archive, last, kColumns, train::Classification::num_sums);
      CHECK(state.epochs_done == 1);
    }
  }

  TEST_CASE(
      "asynchronous checkpoints: the same files as synchronous ones (last, "
      "last-prev, best-k and best.pt), what they cost in summary.json, and a "
      "resume from them continues bit for bit") {
    auto d = make_data(64, 20);
    auto run = [&](const fs::path& out, bool async, int epochs,
                   const std::string& resume) {
      torch::manual_seed(3);
      SingleDeviceTrainer<TinyNet> trainer(TinyNet(), adam(),
                                           base_options(out, epochs)
                                               .keep_best(2)
                                               .async_checkpoints(async)
                                               .resume(resume)
                                               .verbose(false));
      return trainer.fit(d.train, d.val, data::CifarTrain{}, data::CifarEval{},
                         data::LoaderOptions(16).workers(0));
    };
    TempDir sync, async, resumed;
    run(sync.path(), false, 4, "");
    run(async.path(), true, 4, "");
    std::set<std::string> names_sync, names_async;
    for (const auto& f : fs::directory_iterator(sync / "checkpoints")) {
      names_sync.insert(f.path().filename().string());
    }
    for (const auto& f : fs::directory_iterator(async / "checkpoints")) {
      names_async.insert(f.path().filename().string());
    }
    CHECK(names_sync == names_async);
    CHECK(names_async.count("best.pt") == 1);
    for (const auto& name : names_sync) {
      CAPTURE(name);
      auto ms = model_of(sync / "checkpoints" / name);
      auto ma = model_of(async / "checkpoints" / name);
      for (auto& kv : ms) {
        CHECK(torch::equal(kv.value().toTensor(), ma.at(kv.key()).toTensor()));
      }
    }
    const std::string summary = read_file(async / "summary.json");
    CAPTURE(summary);
    CHECK(summary.find("\"async_checkpoints\": true") != std::string::npos);
    CHECK(summary.find("\"checkpoint_ms\": {\"blocking\":") !=
          std::string::npos);
    CHECK(summary.find("\"drain\":") != std::string::npos);
    CHECK(read_file(sync / "summary.json").find("\"drain\"") ==
          std::string::npos);
    CHECK(
        read_file(sync / "summary.json").find("\"async_checkpoints\": false") !=
        std::string::npos);
    // 2 epochs, then resumed to 4, all asynchronous: as the 4 in one go.
    run(resumed.path(), true, 2, "");
    run(resumed.path(), true, 4, "auto");
    auto ma = model_of(async / "checkpoints/last.pt");
    auto mr = model_of(resumed / "checkpoints/last.pt");
    for (auto& kv : ma) {
      CHECK(torch::equal(kv.value().toTensor(), mr.at(kv.key()).toTensor()));
    }
  }

  TEST_CASE(
      "asynchronous checkpoints: kill -9 during a background write leaves "
      "the previous checkpoint whole, and a resume continues from it") {
    TempDir dir;
    auto res = run_workers("trainer_async_kill", 1, dir.str());
    CHECK_FALSE(res.ok());
    REQUIRE_MESSAGE(fs::exists(dir / "out" / "killing"),
                    "the worker never saw a background write in progress");
    const fs::path ck = dir / "out" / "checkpoints";
    bool temporary_left = false;
    for (const auto& f : fs::directory_iterator(ck)) {
      temporary_left |=
          f.path().filename().string().rfind("last.pt.tmp-", 0) == 0;
    }
    CHECK(temporary_left);  // killed mid-write
    auto archive = train::open_checkpoint(ck / "last.pt");
    const auto state = train::TrainingState::load(
        archive, ck / "last.pt", kColumns, train::Classification::num_sums);
    CHECK(state.epochs_done >= 1);
    CHECK(state.epochs_done <= 2);
  }
}  // TEST_SUITE("train")
