// DPTRAIN_FAULT parsing and which faults a rank and generation keep.
#include "core/fault.hpp"

#include <doctest/doctest.h>

#include <chrono>

#include "core/error.hpp"

using namespace dptrain;

TEST_CASE("fault specs parse, with every field and several faults") {
  const auto faults =
      parse_faults("crash@step=37,rank=1;exit@step=5,code=7,gen=2;slow@step=3,ms=20");
  REQUIRE(faults.size() == 3);
  CHECK(faults[0].kind == Fault::Kind::crash);
  CHECK(faults[0].step == 37);
  CHECK(faults[0].rank == 1);
  CHECK(faults[0].generation == -1);
  CHECK(faults[1].kind == Fault::Kind::exit);
  CHECK(faults[1].code == 7);
  CHECK(faults[1].generation == 2);
  CHECK(faults[2].kind == Fault::Kind::slow);
  CHECK(faults[2].rank == -1);
  CHECK(faults[2].ms == 20);
  CHECK(parse_faults("").empty());
  // Before the ranks meet there is no step.
  const auto join = parse_faults("freeze-before-join@rank=1,gen=1");
  REQUIRE(join.size() == 1);
  CHECK(join[0].kind == Fault::Kind::freeze_before_join);
  CHECK(join[0].rank == 1);
  CHECK(unreachable_faults(join, 10, 2, 0).empty());
  CHECK(unreachable_faults(join, 10, 1, 0).size() == 1);  // no rank 1
  CHECK(unreachable_faults(parse_faults("freeze-before-join"), 10, 2, 0).size() == 1);
  // A slow start: after the ranks meet, before the first step; every rank may have one.
  const auto start = parse_faults("slow-start@rank=1,ms=250");
  REQUIRE(start.size() == 1);
  CHECK(start[0].kind == Fault::Kind::slow_start);
  CHECK(start[0].ms == 250);
  CHECK(unreachable_faults(start, 10, 2, 0).empty());
  CHECK(unreachable_faults(parse_faults("slow-start@ms=5"), 10, 1, 0).empty());
  CHECK(unreachable_faults(start, 10, 1, 0).size() == 1);  // no rank 1
  const auto t0 = std::chrono::steady_clock::now();
  FaultInjector(start, 1, 1).before_step(0);  // not a step's fault
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200));
  FaultInjector(start, 1, 1).after_join();
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(250));
}

TEST_CASE("bad fault specs are usage errors naming the part") {
  for (const char* bad : {"explode@step=3", "crash@rank=1", "crash@step=x", "crash@step=1,when=2",
                          "freeze-before-join@step=0,rank=1", "slow-start@step=0,ms=5"}) {
    CAPTURE(bad);
    try {
      parse_faults(bad);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::usage);
      CHECK(std::string(e.what()).find("DPTRAIN_FAULT") != std::string::npos);
    }
  }
}

TEST_CASE("an injector keeps only its rank's and generation's faults") {
  const auto faults = parse_faults("slow@step=0,rank=1,ms=1;slow@step=0,gen=3,ms=1");
  CHECK(FaultInjector(faults, 0, 1).empty());
  CHECK_FALSE(FaultInjector(faults, 1, 1).empty());
  CHECK_FALSE(FaultInjector(faults, 0, 3).empty());
  FaultInjector(faults, 1, 3).before_step(5);  // slow faults return
}

TEST_CASE("faults that can never fire are named") {
  const auto faults = parse_faults(
      "crash@step=40;crash@step=39,rank=1;exit@step=3,rank=7;crash-in-checkpoint@step=15;"
      "crash-in-checkpoint@step=20;crash-in-checkpoint@step=40;slow@step=0,ms=5");
  CHECK(faults[0].text == "crash@step=40");
  const auto warnings = unreachable_faults(faults, 40, 2, 10);
  REQUIRE(warnings.size() == 3);
  CHECK(warnings[0] ==
        "DPTRAIN_FAULT 'crash@step=40' never fires: step 40 is past the run's steps (0 to 39)");
  CHECK(warnings[1] == "DPTRAIN_FAULT 'exit@step=3,rank=7' never fires: there are ranks 0 to 1");
  CHECK(warnings[2] ==
        "DPTRAIN_FAULT 'crash-in-checkpoint@step=15' fires only if a stop writes a checkpoint "
        "there: step 15 is not one of the run's checkpoint steps (every 10, and 40)");
  CHECK(unreachable_faults(faults, 40, 8, 5).size() == 1);  // rank 7 exists; 15 is a multiple
  // Ranks without checkpoints (a benchmark's): no crash-in-checkpoint fires.
  const auto none = unreachable_faults(faults, 40, 8, kNoCheckpoints);
  REQUIRE(none.size() == 4);
  CHECK(none[3] ==
        "DPTRAIN_FAULT 'crash-in-checkpoint@step=40' never fires: these ranks write no "
        "checkpoints");
  // Only the ranks that write checkpoints can crash in one.
  const auto ranks = parse_faults(
      "crash-in-checkpoint@step=20,rank=1;crash-in-checkpoint@step=20,rank=4;"
      "crash-in-checkpoint@step=20");
  const auto one_host = unreachable_faults(ranks, 40, 8, 10);
  REQUIRE(one_host.size() == 2);
  CHECK(one_host[0] ==
        "DPTRAIN_FAULT 'crash-in-checkpoint@step=20,rank=1' never fires: rank 1 writes no "
        "checkpoints (rank 0 does)");
  const auto two_hosts = unreachable_faults(ranks, 40, 8, 10, {0, 4});
  REQUIRE(two_hosts.size() == 1);
  CHECK(two_hosts[0] ==
        "DPTRAIN_FAULT 'crash-in-checkpoint@step=20,rank=1' never fires: rank 1 writes no "
        "checkpoints (ranks 0, 4 do)");
}

TEST_CASE("fault specs with values out of range, a field twice or for another kind are refused") {
  for (const auto& [spec, message] : std::vector<std::pair<std::string, std::string>>{
           {"exit@step=3,code=300",
            "DPTRAIN_FAULT: code=300 in 'exit@step=3,code=300' is not an "
            "exit code (0 to 255)"},
           {"slow@step=3,ms=-5",
            "DPTRAIN_FAULT: ms=-5 in 'slow@step=3,ms=-5' is not a pause (1 ms or more)"},
           {"slow@step=3,ms=0",
            "DPTRAIN_FAULT: ms=0 in 'slow@step=3,ms=0' is not a pause (1 ms or more)"},
           {"slow@step=5", "DPTRAIN_FAULT: 'slow@step=5' needs ms=M, its pause before every step"},
           {"crash@step=5,ms=100",
            "DPTRAIN_FAULT: ms= in 'crash@step=5,ms=100' is only for slow and slow-start faults"},
           {"slow-start@rank=1",
            "DPTRAIN_FAULT: 'slow-start@rank=1' needs ms=M, its pause before the first step"},
           {"slow@step=5,ms=10,code=3",
            "DPTRAIN_FAULT: code= in 'slow@step=5,ms=10,code=3' is only for exit faults"},
           {"crash@step=-1", "DPTRAIN_FAULT: step=-1 in 'crash@step=-1' is not a step (0 or more)"},
           {"crash@step=3,rank=1,rank=0",
            "DPTRAIN_FAULT: 'rank' is given twice in 'crash@step=3,rank=1,rank=0'"},
           {"crash@step=3,gen=0",
            "DPTRAIN_FAULT: gen=0 in 'crash@step=3,gen=0' is not a "
            "generation (1 or more)"},
           // A kind that needs no step= still takes its options after '@'.
           {"freeze-before-join,rank=1",
            "DPTRAIN_FAULT: 'freeze-before-join,rank=1': a fault's options follow '@' "
            "(freeze-before-join@rank=1)"},
           {"slow,ms=5@step=3",
            "DPTRAIN_FAULT: 'slow,ms=5@step=3': a fault's options follow '@' (slow@ms=5,step=3)"},
           {"boom@step=3",
            "DPTRAIN_FAULT: unknown fault 'boom' in 'boom@step=3' (crash, exit, hang, freeze, "
            "slow, crash-in-checkpoint, freeze-before-join, slow-start)"}}) {
    CAPTURE(spec);
    try {
      parse_faults(spec);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::usage);
      CHECK(std::string(e.what()) == message);
    }
  }
}

TEST_CASE("on a resume, faults before its step or generation never fire") {
  const auto faults =
      parse_faults("crash@step=5;crash@step=30,gen=1;crash@step=30,gen=2;slow@step=1,ms=1");
  const auto warnings = unreachable_faults(faults, 40, 2, 10, {0}, 21, 2);
  REQUIRE(warnings.size() == 2);
  CHECK(warnings[0] == "DPTRAIN_FAULT 'crash@step=5' never fires: the run continues from step 21");
  CHECK(warnings[1] ==
        "DPTRAIN_FAULT 'crash@step=30,gen=1' never fires: this invocation starts at generation 2");
}
