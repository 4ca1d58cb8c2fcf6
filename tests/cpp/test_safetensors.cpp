// Tests of safetensors reading/writing: round trips of every dtype, every header violation the
// reader must reject (files crafted byte by byte), zero-copy and copy-on-write behaviour, sharded
// checkpoints and atomic writes.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/io/safetensors.h"

namespace automoe {
namespace {

namespace fs = std::filesystem;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

// Passes when `fn` throws automoe::Error whose message contains every one of `parts`.
template <typename Fn>
testing::AssertionResult ThrowsWith(Fn&& fn, std::initializer_list<std::string> parts) {
  std::string msg;
  try {
    fn();
    return testing::AssertionFailure() << "no exception thrown";
  } catch (const Error& e) {
    msg = e.what();
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "not an automoe::Error: " << e.what();
  }
  for (const std::string& part : parts) {
    if (msg.find(part) == std::string::npos) {
      return testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << part << "\"";
    }
  }
  return testing::AssertionSuccess() << msg;
}

bool SameBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  at::Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

// A tensor of random bytes (0/1 for bool, so every value is a valid bool). Float bit patterns may
// be NaNs; comparisons are bytewise, so that does not matter.
at::Tensor RandomTensor(std::mt19937_64& rng, c10::ScalarType dtype, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  auto* p = static_cast<unsigned char*>(t.data_ptr());
  for (size_t i = 0; i < t.nbytes(); ++i) {
    p[i] = dtype == c10::kBool ? rng() & 1 : static_cast<unsigned char>(rng());
  }
  return t;
}

std::string ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteBytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string U64(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}

class SafetensorsTest : public testing::Test {
 protected:
  void SetUp() override {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("automoe_st_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // A safetensors file byte by byte: u64 header length, header, data.
  std::string WriteRaw(const std::string& header, const std::string& data = "",
                       const std::string& name = "raw.safetensors") const {
    WriteBytes(dir_ / name, U64(header.size()) + header + data);
    return Path(name);
  }

  std::set<std::string> DirEntries() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.insert(e.path().filename().string());
    return out;
  }

  fs::path dir_;
};

// ---- round trips ----

TEST_F(SafetensorsTest, RoundTripsEveryDtype) {
  std::mt19937_64 rng(20240611);
  const std::vector<c10::ScalarType> dtypes = {
      c10::kDouble, c10::kFloat, c10::kHalf,          c10::kBFloat16,
      c10::kLong,   c10::kInt,   c10::kShort,         c10::kChar,
      c10::kByte,   c10::kBool,  c10::kFloat8_e4m3fn, c10::kFloat8_e5m2};
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {3, 0, 2}, {7}, {3, 5}, {2, 3, 5}};
  Tensors tensors;
  for (auto dtype : dtypes) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      tensors.emplace_back(std::string(c10::toString(dtype)) + "." + std::to_string(s),
                           RandomTensor(rng, dtype, shapes[s]));
    }
  }
  const std::string path = Path("all.safetensors");
  save_safetensors(path, tensors);

  SafetensorsFile file(path);
  std::vector<std::string> expected_names;
  for (const auto& [name, _] : tensors) expected_names.push_back(name);
  EXPECT_EQ(file.names(), expected_names);  // written in the given order
  for (const auto& [name, t] : tensors) {
    at::Tensor got = file.get(name);
    EXPECT_TRUE(SameBytes(got, t)) << name;
    EXPECT_EQ(file.info(name).dtype, t.scalar_type()) << name;
    EXPECT_EQ(file.info(name).shape, t.sizes().vec()) << name;
  }
}

TEST_F(SafetensorsTest, PadsHeaderSoTensorsAreAlignedAndZeroCopy) {
  for (int extra = 0; extra < 8; ++extra) {  // names of every length mod 8
    const std::string path = Path("pad.safetensors");
    Tensors tensors = {{std::string(extra + 1, 'n'), at::arange(5, at::kDouble)},
                       {"b", at::arange(8, at::kByte)},
                       {"c", at::arange(4, at::kLong)}};
    save_safetensors(path, tensors);
    const std::string bytes = ReadBytes(path);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    EXPECT_EQ((8 + n) % 8, 0u);
    EXPECT_EQ(bytes.find_last_not_of(' ', 8 + n - 1), bytes.find_last_of('}', 8 + n - 1));

    SafetensorsFile file(path);
    at::Tensor a = file.get(tensors[0].first), c = file.get("c");
    // Zero-copy: consecutive tensors sit at consecutive addresses of the one mapping.
    EXPECT_EQ(static_cast<char*>(c.data_ptr()) - static_cast<char*>(a.data_ptr()), 5 * 8 + 8);
    EXPECT_TRUE(at::equal(a, tensors[0].second));
  }
}

TEST_F(SafetensorsTest, RoundTripsMetadataAndAddsFormat) {
  const std::string path = Path("meta.safetensors");
  save_safetensors(path, {{"x", at::zeros({2})}}, {{"author", "me"}});
  EXPECT_EQ(SafetensorsFile(path).metadata(),
            (std::map<std::string, std::string>{{"author", "me"}, {"format", "pt"}}));

  save_safetensors(path, {{"x", at::zeros({2})}}, {{"format", "np"}});
  EXPECT_EQ(SafetensorsFile(path).metadata(),
            (std::map<std::string, std::string>{{"format", "np"}}));
}

TEST_F(SafetensorsTest, WritesNonContiguousTensorsContiguously) {
  at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4}).t();
  ASSERT_FALSE(t.is_contiguous());
  const std::string path = Path("t.safetensors");
  save_safetensors(path, {{"t", t}, {"s", at::arange(10, at::kInt).slice(0, 2, 5)}});
  SafetensorsFile file(path);
  EXPECT_TRUE(at::equal(file.get("t"), t));
  EXPECT_TRUE(at::equal(file.get("s"), at::arange(2, 5, at::kInt)));
}

TEST_F(SafetensorsTest, RejectsDuplicateNamesOnSave) {
  const std::string path = Path("dup.safetensors");
  EXPECT_TRUE(ThrowsWith(
      [&] {
        save_safetensors(path, {{"w", at::zeros({1})}, {"w", at::zeros({2})}});
      },
      {path, "duplicate tensor name", "\"w\""}));
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(SafetensorsTest, RejectsUnsupportedDtypeOnSave) {
  const std::string path = Path("c.safetensors");
  EXPECT_TRUE(ThrowsWith(
      [&] {
        save_safetensors(path, {{"z", at::zeros({2}, at::kComplexFloat)}});
      },
      {path, "\"z\"", "cannot store"}));
  EXPECT_EQ(DirEntries(), std::set<std::string>{});
}

TEST_F(SafetensorsTest, ReadsFileWrittenByHand) {
  // Layout exactly as the python package writes it: offsets relative to the data area.
  std::string data(16, '\0');
  const float f[2] = {1.5f, -2.0f};
  const int32_t i[2] = {7, -9};
  std::memcpy(data.data(), f, 8);
  std::memcpy(data.data() + 8, i, 8);
  const std::string path =
      WriteRaw(R"({"__metadata__":{"k":"v"},"i":{"dtype":"I32","shape":[2],"data_offsets":[8,16]},)"
               R"("f":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}})",
               data);
  SafetensorsFile file(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"f", "i"}));
  EXPECT_EQ(file.metadata().at("k"), "v");
  EXPECT_EQ(file.get("f")[1][0].item<float>(), -2.0f);
  EXPECT_EQ(file.get("i")[1].item<int32_t>(), -9);
  EXPECT_TRUE(file.contains("f"));
  EXPECT_FALSE(file.contains("g"));
  EXPECT_TRUE(ThrowsWith([&] { file.info("g"); }, {path, "\"g\"", "no tensor named"}));
}

TEST_F(SafetensorsTest, AcceptsEmptyHeaderAndZeroSizeTensors) {
  EXPECT_TRUE(SafetensorsFile(WriteRaw("{}", "", "empty.safetensors")).names().empty());
  const std::string path = WriteRaw(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                    R"("z":{"dtype":"F32","shape":[4,0],"data_offsets":[2,2]},)"
                                    R"("e":{"dtype":"F64","shape":[0],"data_offsets":[3,3]},)"
                                    R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                                    "xyz");
  SafetensorsFile file(path);
  EXPECT_EQ(file.get("z").sizes().vec(), (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(file.get("e").numel(), 0);
  EXPECT_EQ(file.get("b")[0].item<uint8_t>(), 'z');
}

TEST_F(SafetensorsTest, CopiesMisalignedTensors) {
  // Header of odd length and no padding: the F32 data starts at an odd file offset.
  std::string header = R"({"f":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  if ((8 + header.size()) % 2 == 0) header += " ";
  const float v[3] = {1.0f, 2.5f, -3.0f};
  const std::string path = WriteRaw(header, std::string(reinterpret_cast<const char*>(v), 12));
  SafetensorsFile file(path);
  at::Tensor t = file.get("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % alignof(float), 0u);
  EXPECT_EQ(t[2].item<float>(), -3.0f);
  at::Tensor rows = file.get_rows("f", 1, 3);
  EXPECT_EQ(rows[0].item<float>(), 2.5f);

  // Aligned data area, but an I64 after 3 bytes of U8 starts at an odd offset.
  const std::string path2 = Path("odd.safetensors");
  save_safetensors(path2, {{"u", at::arange(3, at::kByte)}, {"l", at::arange(4, at::kLong)}});
  at::Tensor l = SafetensorsFile(path2).get("l");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(l.data_ptr()) % alignof(int64_t), 0u);
  EXPECT_TRUE(at::equal(l, at::arange(4, at::kLong)));
}

// ---- rejected headers ----

TEST_F(SafetensorsTest, RejectsTruncatedFile) {
  for (size_t len : {0, 5, 7}) {
    WriteBytes(dir_ / "short.safetensors", std::string(len, '\0'));
    const std::string path = Path("short.safetensors");
    EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); }, {path, "file too short"}));
  }
}

TEST_F(SafetensorsTest, RejectsMissingFile) {
  const std::string path = Path("nope.safetensors");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); }, {path, "cannot open"}));
}

TEST_F(SafetensorsTest, RejectsHeaderLengthPastEnd) {
  for (uint64_t n : {uint64_t{3}, uint64_t{1} << 40, ~uint64_t{0}, ~uint64_t{0} - 7}) {
    WriteBytes(dir_ / "len.safetensors", U64(n) + "{}");
    const std::string path = Path("len.safetensors");
    EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); },
                           {path, "header length past end of file", std::to_string(n)}));
  }
}

TEST_F(SafetensorsTest, RejectsBadJson) {
  for (const char* header : {"", "{", R"({"a":)", "{}}", "not json", "{\"a\":1,}"}) {
    const std::string path = WriteRaw(header);
    EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); }, {path, "not valid JSON"})) << header;
  }
}

TEST_F(SafetensorsTest, RejectsNonObjectHeader) {
  for (const char* header : {"[]", "3", "\"x\"", "null"}) {
    const std::string path = WriteRaw(header);
    EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); }, {path, "not a JSON object"}));
  }
}

TEST_F(SafetensorsTest, RejectsDuplicateTensorNameInHeader) {
  const std::string path = WriteRaw(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                    R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                                    "ab");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); }, {path, "\"w\"", "more than once"}));
}

TEST_F(SafetensorsTest, RejectsMalformedEntries) {
  struct Case {
    const char* entry;
    const char* phrase;
  };
  const Case cases[] = {
      {R"([1])", "entry is not a JSON object"},
      {R"("F32")", "entry is not a JSON object"},
      {R"({"shape":[1],"data_offsets":[0,1]})", "missing \"dtype\""},
      {R"({"dtype":5,"shape":[1],"data_offsets":[0,1]})", "\"dtype\" must be a string"},
      {R"({"dtype":"U8","data_offsets":[0,1]})", "missing \"shape\""},
      {R"({"dtype":"U8","shape":1,"data_offsets":[0,1]})", "\"shape\" must be an array"},
      {R"({"dtype":"U8","shape":[1.0],"data_offsets":[0,1]})", "must be a non-negative integer"},
      {R"({"dtype":"U8","shape":["1"],"data_offsets":[0,1]})", "must be a non-negative integer"},
      {R"({"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,1]})",
       "must be a non-negative integer"},
      {R"({"dtype":"U8","shape":[1]})", "missing \"data_offsets\""},
      {R"({"dtype":"U8","shape":[1],"data_offsets":[0]})", "\"data_offsets\" must be [begin, end]"},
      {R"({"dtype":"U8","shape":[1],"data_offsets":[0,1,2]})", "\"data_offsets\" must be"},
      {R"({"dtype":"U8","shape":[1],"data_offsets":{"a":0}})", "\"data_offsets\" must be"},
      {R"({"dtype":"U8","shape":[1],"data_offsets":[-1,0]})", "\"data_offsets\" must be"},
      {R"({"dtype":"U8","shape":[1],"data_offsets":[0.0,1]})", "\"data_offsets\" must be"},
      {R"({"dtype":"U8","shape":[0],"data_offsets":[1,0]})", "0 <= begin <= end"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteRaw(std::string(R"({"bad.w":)") + c.entry + "}", "x");
    EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); }, {path, "\"bad.w\"", c.phrase}))
        << c.entry;
  }
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  for (const char* dtype : {"F7", "f32", "C64", ""}) {
    const std::string path = WriteRaw(
        std::string(R"({"w":{"dtype":")") + dtype + R"(","shape":[1],"data_offsets":[0,4]}})",
        "abcd");
    EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); },
                           {path, "\"w\"", "unknown dtype", std::string("\"") + dtype + "\""}));
  }
}

TEST_F(SafetensorsTest, RejectsNegativeShapeDim) {
  const std::string path = WriteRaw(R"({"w":{"dtype":"U8","shape":[2,-1],"data_offsets":[0,0]}})");
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsFile f(path); }, {path, "\"w\"", "negative shape dim -1"}));
}

TEST_F(SafetensorsTest, RejectsShapeProductOverflow) {
  // 2^32 * 2^32 * 4 bytes wraps to 0 in 64 bits, which would match a [0, 0] range.
  const std::string path =
      WriteRaw(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); }, {path, "\"w\"", "overflows"}));
}

TEST_F(SafetensorsTest, RejectsEmptyShapesWhoseStridesOverflow) {
  // No bytes (a zero dim), but the other dims' product overflows int64: PyTorch cannot stride it
  // (found by fuzz_safetensors_header: c10::Error escaped from get()).
  const std::string path = WriteRaw(
      R"({"w":{"dtype":"F32","shape":[0,9223372036854775807,2],"data_offsets":[0,0]}})");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); },
                         {path, "\"w\"", "product of its non-zero dims overflows"}));
  // Where the strides fit, an empty tensor of a huge shape is valid: [0, 2^60] F32.
  const std::string ok = WriteRaw(
      R"({"w":{"dtype":"F32","shape":[0,1152921504606846976],"data_offsets":[0,0]}})", "",
      "ok.safetensors");
  SafetensorsFile f(ok);
  EXPECT_EQ(f.get("w").numel(), 0);
  EXPECT_EQ(f.get("w").size(1), int64_t{1} << 60);
}

TEST_F(SafetensorsTest, RejectsShapeSizeMismatch) {
  const std::string path = WriteRaw(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
                                    std::string(20, 'x'));
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); },
                         {path, "\"w\"", "shape/size mismatch", "needs 24 bytes", "span 20"}));
}

TEST_F(SafetensorsTest, RejectsOutOfRangeOffsets) {
  const std::string path =
      WriteRaw(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})", std::string(20, 'x'));
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsFile f(path); }, {path, "\"w\"", "out of range", "20 bytes"}));
  // Offsets near 2^64: the range check must not wrap around.
  const std::string path2 =
      WriteRaw(R"({"w":{"dtype":"U8","shape":[2],)"
               R"("data_offsets":[18446744073709551614,18446744073709551615]}})",
               "", "wrap.safetensors");
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsFile f(path2); }, {path2, "\"w\"", "shape/size mismatch"}));
  const std::string path3 =
      WriteRaw(R"({"w":{"dtype":"U8","shape":[1],)"
               R"("data_offsets":[18446744073709551614,18446744073709551615]}})",
               "", "wrap3.safetensors");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path3); }, {path3, "\"w\"", "out of range"}));
}

TEST_F(SafetensorsTest, RejectsOverlappingOffsets) {
  const std::string path = WriteRaw(R"({"first":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                                    R"("second":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                                    std::string(12, 'x'));
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsFile f(path); }, {path, "\"first\"", "\"second\"", "overlap"}));
  // A zero-size tensor strictly inside another overlaps it too.
  const std::string path2 = WriteRaw(R"({"big":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                                     R"("empty":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}})",
                                     std::string(8, 'x'), "inside.safetensors");
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsFile f(path2); }, {path2, "\"big\"", "\"empty\"", "overlap"}));
}

TEST_F(SafetensorsTest, RejectsGapBetweenTensors) {
  const std::string path = WriteRaw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                    R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                                    std::string(10, 'x'));
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsFile f(path); }, {path, "gap of 2 bytes", "\"a\"", "\"b\""}));
  const std::string path2 = WriteRaw(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                                     std::string(8, 'x'), "start.safetensors");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path2); }, {path2, "gap of 4 bytes", "\"b\""}));
}

TEST_F(SafetensorsTest, RejectsTrailingBytes) {
  const std::string path =
      WriteRaw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", std::string(7, 'x'));
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); },
                         {path, "not fully covered", "3 trailing bytes"}));
  const std::string path2 = WriteRaw("{}", "x", "notensors.safetensors");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path2); }, {path2, "1 trailing bytes"}));
}

TEST_F(SafetensorsTest, RejectsNonStringMetadata) {
  const std::string path = WriteRaw(R"({"__metadata__":{"format":"pt","n":3}})");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(path); },
                         {path, "__metadata__", "\"n\"", "must be a string"}));
  for (const char* meta : {"[]", "\"pt\"", "null"}) {
    const std::string p = WriteRaw(std::string(R"({"__metadata__":)") + meta + "}");
    EXPECT_TRUE(ThrowsWith([&] { SafetensorsFile f(p); },
                           {p, "__metadata__ must be an object of string to string"}));
  }
}

// ---- zero copy, copy-on-write, rows ----

TEST_F(SafetensorsTest, ReadsRowRangeWithoutCopy) {
  at::Tensor w = at::arange(5 * 3 * 2, at::kFloat).reshape({5, 3, 2});
  const std::string path = Path("rows.safetensors");
  save_safetensors(path, {{"experts", w}});
  SafetensorsFile file(path);
  at::Tensor all = file.get("experts");
  at::Tensor rows = file.get_rows("experts", 1, 4);
  EXPECT_EQ(rows.sizes().vec(), (std::vector<int64_t>{3, 3, 2}));
  EXPECT_TRUE(at::equal(rows, w.slice(0, 1, 4)));
  EXPECT_EQ(static_cast<char*>(rows.data_ptr()), static_cast<char*>(all.data_ptr()) + 1 * 6 * 4);
  EXPECT_EQ(file.get_rows("experts", 5, 5).numel(), 0);
  EXPECT_EQ(file.get_rows("experts", 0, 5).sizes(), w.sizes());
}

TEST_F(SafetensorsTest, RejectsBadRowRange) {
  const std::string path = Path("rows.safetensors");
  save_safetensors(path, {{"m", at::zeros({4, 2})}, {"s", at::zeros({})}});
  SafetensorsFile file(path);
  for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{-1, 2}, {3, 2}, {0, 5}, {5, 5}}) {
    EXPECT_TRUE(
        ThrowsWith([&] { file.get_rows("m", b, e); }, {path, "\"m\"", "0 <= begin <= end <= 4"}));
  }
  EXPECT_TRUE(
      ThrowsWith([&] { file.get_rows("s", 0, 0); }, {path, "\"s\"", "at least 1 dimension"}));
}

TEST_F(SafetensorsTest, WritesAreCopyOnWrite) {
  const std::string path = Path("cow.safetensors");
  at::Tensor w = at::arange(1024, at::kFloat);
  save_safetensors(path, {{"w", w}});
  const std::string before = ReadBytes(path);
  {
    SafetensorsFile file(path);
    at::Tensor t = file.get("w");
    t.fill_(42.0f);
    file.get_rows("w", 0, 1).fill_(7.0f);
    EXPECT_EQ(t[0].item<float>(), 7.0f);  // same private mapping
    EXPECT_EQ(t[1].item<float>(), 42.0f);
  }
  EXPECT_EQ(ReadBytes(path), before);
  EXPECT_TRUE(at::equal(SafetensorsFile(path).get("w"), w));
}

TEST_F(SafetensorsTest, TensorsOutliveTheFile) {
  const std::string path = Path("live.safetensors");
  at::Tensor w = at::arange(100, at::kLong);
  save_safetensors(path, {{"w", w}});
  at::Tensor t, rows;
  {
    SafetensorsFile file(path);
    t = file.get("w");
    rows = file.get_rows("w", 10, 20);
    SafetensorsFile moved(std::move(file));
    EXPECT_EQ(moved.names(), std::vector<std::string>{"w"});
  }
  fs::remove(path);
  EXPECT_TRUE(at::equal(t, w));
  EXPECT_TRUE(at::equal(rows, w.slice(0, 10, 20)));
}

// ---- atomic writes ----

TEST_F(SafetensorsTest, WritesAtomicallyNoTempLeft) {
  const std::string path = Path("a.safetensors");
  save_safetensors(path, {{"w", at::arange(8, at::kFloat)}});
  SafetensorsFile old_file(path);
  at::Tensor old_w = old_file.get("w");
  // Overwriting replaces the file by rename: the existing mapping keeps the old contents.
  save_safetensors(path, {{"w", at::zeros({8})}, {"v", at::ones({2})}});
  EXPECT_TRUE(at::equal(old_w, at::arange(8, at::kFloat)));
  EXPECT_EQ(SafetensorsFile(path).names(), (std::vector<std::string>{"w", "v"}));
  write_file_atomic(Path("note.txt"), "hello\n");
  write_file_atomic(Path("note.txt"), "bye\n");
  EXPECT_EQ(ReadBytes(dir_ / "note.txt"), "bye\n");
  EXPECT_EQ(DirEntries(), (std::set<std::string>{"a.safetensors", "note.txt"}));
}

TEST_F(SafetensorsTest, FailedWriteKeepsOldFileAndRemovesTemp) {
  const std::string path = Path("keep.safetensors");
  save_safetensors(path, {{"w", at::arange(4, at::kFloat)}});
  const std::string before = ReadBytes(path);
  // A meta tensor passes the header checks but has no bytes: the failure comes mid-write.
  at::Tensor meta = at::empty({4}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  EXPECT_TRUE(ThrowsWith(
      [&] {
        save_safetensors(path, {{"ok", at::zeros({2})}, {"m", meta}});
      },
      {path, "\"m\""}));
  EXPECT_EQ(ReadBytes(path), before);
  EXPECT_EQ(DirEntries(), std::set<std::string>{"keep.safetensors"});
}

TEST_F(SafetensorsTest, ReportsWriteFailureWithPathAndErrno) {
  const std::string path = Path("missing_dir/a.safetensors");
  EXPECT_TRUE(ThrowsWith(
      [&] {
        save_safetensors(path, {{"w", at::zeros({1})}});
      },
      {path, "No such file or directory"}));
  EXPECT_TRUE(
      ThrowsWith([&] { write_file_atomic(path, "x"); }, {path, "No such file or directory"}));
  EXPECT_EQ(DirEntries(), std::set<std::string>{});
}

// ---- sharding and checkpoints ----

TEST_F(SafetensorsTest, SingleFileWhenEverythingFits) {
  Tensors tensors = {{"a", at::zeros({10})}, {"b", at::ones({3, 3}, at::kBFloat16)}};
  EXPECT_EQ(save_sharded(dir_.string(), tensors, 1000),
            std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(DirEntries(), std::set<std::string>{"model.safetensors"});
  SafetensorsCheckpoint ckpt(dir_.string());
  EXPECT_EQ(ckpt.num_files(), 1u);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(at::equal(ckpt.get("b"), tensors[1].second));
}

TEST_F(SafetensorsTest, ShardsAndWritesIndex) {
  // 40, 40, 100 (over the limit: alone), 8, 40 bytes with a 90-byte limit.
  Tensors tensors = {{"l0.w", at::arange(10, at::kFloat)},
                     {"l0.b", at::arange(10, at::kInt)},
                     {"embed", at::arange(25, at::kFloat)},
                     {"l1.w", at::arange(4, at::kShort)},
                     {"l1.b", at::arange(5, at::kDouble)}};
  const auto files = save_sharded(dir_.string(), tensors, 90);
  const std::vector<std::string> expected = {"model-00001-of-00003.safetensors",
                                             "model-00002-of-00003.safetensors",
                                             "model-00003-of-00003.safetensors"};
  EXPECT_EQ(files, expected);

  const std::string index_text = ReadBytes(dir_ / "model.safetensors.index.json");
  const auto index = nlohmann::json::parse(index_text);
  EXPECT_EQ(index["metadata"]["total_size"], 40 + 40 + 100 + 8 + 40);
  EXPECT_EQ(index["weight_map"], (nlohmann::json{{"l0.w", expected[0]},
                                                 {"l0.b", expected[0]},
                                                 {"embed", expected[1]},
                                                 {"l1.w", expected[2]},
                                                 {"l1.b", expected[2]}}));
  EXPECT_NE(index_text.find("\n  \"metadata\""), std::string::npos);     // indented 2 spaces
  EXPECT_LT(index_text.find("\"embed\""), index_text.find("\"l0.b\""));  // sorted keys
  EXPECT_EQ(SafetensorsFile(Path(expected[2])).names(), (std::vector<std::string>{"l1.w", "l1.b"}));

  SafetensorsCheckpoint ckpt(dir_.string());
  EXPECT_EQ(ckpt.num_files(), 3u);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"embed", "l0.b", "l0.w", "l1.b", "l1.w"}));
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(ckpt.get(name), t)) << name;
  EXPECT_EQ(ckpt.info("l1.b").dtype, c10::kDouble);
  EXPECT_TRUE(at::equal(ckpt.get_rows("embed", 3, 5), at::arange(3, 5, at::kFloat)));
  EXPECT_TRUE(ThrowsWith([&] { ckpt.get("nope"); }, {dir_.string(), "\"nope\""}));
}

TEST_F(SafetensorsTest, RemovesStaleShards) {
  auto make = [](int n) {
    Tensors t;
    for (int i = 0; i < n; ++i) t.emplace_back("t" + std::to_string(i), at::zeros({4}));
    return t;
  };
  WriteBytes(dir_ / "config.json", "{}");
  WriteBytes(dir_ / "modelcard.md", "x");
  save_sharded(dir_.string(), make(3), 16);
  EXPECT_EQ(DirEntries(), (std::set<std::string>{
                              "config.json", "modelcard.md", "model-00001-of-00003.safetensors",
                              "model-00002-of-00003.safetensors",
                              "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  save_sharded(dir_.string(), make(4), 32);
  EXPECT_EQ(DirEntries(), (std::set<std::string>{
                              "config.json", "modelcard.md", "model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors", "model.safetensors.index.json"}));
  EXPECT_EQ(SafetensorsCheckpoint(dir_.string()).names().size(), 4u);
  save_sharded(dir_.string(), make(2), 1000);
  EXPECT_EQ(DirEntries(),
            (std::set<std::string>{"config.json", "modelcard.md", "model.safetensors"}));
  EXPECT_EQ(SafetensorsCheckpoint(dir_.string()).names().size(), 2u);
}

// Processes of a collective save, played by threads: gather() is an all-gather of strings.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n) {}
  WriteGroup member(int rank) {
    return WriteGroup{rank == 0, [this, rank](const std::string& mine, const char*) {
                        std::unique_lock<std::mutex> lock(mu_);
                        const int64_t gen = generation_;
                        if (slots_.empty()) slots_.resize(n_);
                        slots_[rank] = mine;
                        if (++arrived_ == n_) {
                          result_ = slots_;
                          slots_.clear();
                          arrived_ = 0;
                          ++generation_;
                          cv_.notify_all();
                        } else {
                          cv_.wait(lock, [&] { return generation_ != gen; });
                        }
                        return result_;
                      }};
  }

 private:
  int n_, arrived_ = 0;
  int64_t generation_ = 0;
  std::vector<std::string> slots_, result_;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Runs save_sharded on `parts.size()` threads, each with its slots; returns each one's error.
std::vector<std::string> SaveTogether(const std::string& dir,
                                      const std::vector<std::vector<TensorSlot>>& parts,
                                      uint64_t max_shard_bytes) {
  ThreadGroup group(static_cast<int>(parts.size()));
  std::vector<std::string> errors(parts.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < parts.size(); ++r) {
    threads.emplace_back([&, r] {
      const WriteGroup g = group.member(static_cast<int>(r));
      try {
        save_sharded(dir, parts[r], max_shard_bytes, &g);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST_F(SafetensorsTest, CollectiveSaveWritesTheOneProcessFilesByteForByte) {
  // A dense tensor (rank 0 writes it) and an expert tensor whose rows two ranks hold.
  const at::Tensor dense = at::arange(6, at::kFloat).view({2, 3});
  const at::Tensor experts = at::arange(24, at::kFloat).view({4, 3, 2}).to(at::kBFloat16);
  const at::Tensor scalar = at::ones({}, at::kDouble);
  for (const uint64_t limit : {uint64_t{1000}, uint64_t{30}}) {
    const fs::path one = dir_ / ("one-" + std::to_string(limit)),
                   two = dir_ / ("two-" + std::to_string(limit));
    save_sharded(one.string(), {{"dense", dense}, {"experts", experts}, {"s", scalar}}, limit);
    auto slot = [](const std::string& n, const at::Tensor& full, at::Tensor rows, int64_t begin) {
      return TensorSlot{n, full.scalar_type(), full.sizes().vec(), std::move(rows), begin};
    };
    const auto errors = SaveTogether(
        two.string(),
        {{slot("dense", dense, dense, 0), slot("experts", experts, experts.narrow(0, 0, 2), 0),
          slot("s", scalar, scalar, 0)},
         {slot("dense", dense, {}, 0), slot("experts", experts, experts.narrow(0, 2, 2), 2),
          slot("s", scalar, {}, 0)}},
        limit);
    EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(one)) names.insert(e.path().filename().string());
    EXPECT_EQ(names.size(), limit == 1000 ? 1u : 4u);  // 24 + 48 + 8 bytes at 30: 3 shards + index
    for (const auto& n : names) EXPECT_EQ(ReadBytes(one / n), ReadBytes(two / n)) << n;
    std::set<std::string> written;
    for (const auto& e : fs::directory_iterator(two)) written.insert(e.path().filename().string());
    EXPECT_EQ(written, names);  // no pending files left
  }
}

TEST_F(SafetensorsTest, CollectiveSaveRefusesUncoveredOrDoubledRowsAndNamesAFailingProcess) {
  const at::Tensor experts = at::arange(8, at::kFloat).view({4, 2});
  auto slot = [&](at::Tensor rows, int64_t begin) {
    return TensorSlot{"experts", at::kFloat, {4, 2}, std::move(rows), begin};
  };
  // Rows 2..3 are nobody's: an error on every process, and nothing left in the directory.
  auto errors =
      SaveTogether(dir_.string(), {{slot(experts.narrow(0, 0, 2), 0)}, {slot({}, 0)}}, 1000);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("\"experts\": rows [2, 4) are written by no process"), std::string::npos) << e;
  }
  EXPECT_EQ(DirEntries(), std::set<std::string>{});
  // Rows 1..2 twice and row 3 by nobody: the same byte count, still refused.
  errors =
      SaveTogether(dir_.string(),
                   {{slot(experts.narrow(0, 0, 2), 0)}, {slot(experts.narrow(0, 1, 2), 1)}}, 1000);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rows [1, 2) are written by more than one process"), std::string::npos) << e;
  }
  EXPECT_EQ(DirEntries(), std::set<std::string>{});
  // Processes planning different files (here another shape) are refused before anything is written.
  errors = SaveTogether(
      dir_.string(),
      {{slot(experts.narrow(0, 0, 2), 0)}, {TensorSlot{"experts", at::kFloat, {4, 3}, {}, 0}}},
      1000);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("process 1 plans other files than process 0"), std::string::npos) << e;
  }
  EXPECT_EQ(DirEntries(), std::set<std::string>{});
  // Process 1 holds rows of the wrong dtype: both fail, naming process 1 and the tensor.
  errors = SaveTogether(
      dir_.string(),
      {{slot(experts.narrow(0, 0, 2), 0)}, {slot(experts.narrow(0, 2, 2).to(at::kDouble), 2)}},
      1000);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("process 1"), std::string::npos) << e;
    EXPECT_NE(e.find("\"experts\""), std::string::npos) << e;
  }
  EXPECT_EQ(DirEntries(), std::set<std::string>{});
}

TEST_F(SafetensorsTest, RejectsMissingCheckpointDirectory) {
  const std::string dir = Path("nowhere");
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsCheckpoint c(dir); }, {dir, "does not exist"}));
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); },
                         {dir_.string(), "neither model.safetensors.index.json nor"}));
}

class CheckpointIndexTest : public SafetensorsTest {
 protected:
  void SetUp() override {
    SafetensorsTest::SetUp();
    save_sharded(dir_.string(), {{"a", at::zeros({4})}, {"b", at::zeros({4})}}, 16);
    index_ = Path("model.safetensors.index.json");
  }
  void WriteIndex(const nlohmann::json& weight_map) {
    WriteBytes(
        index_,
        nlohmann::json{{"metadata", nlohmann::json::object()}, {"weight_map", weight_map}}.dump());
  }
  std::string index_;
  const std::string f1_ = "model-00001-of-00002.safetensors";
  const std::string f2_ = "model-00002-of-00002.safetensors";
};

TEST_F(CheckpointIndexTest, RejectsBadIndexJson) {
  WriteBytes(index_, "{\"weight_map\": ");
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); }, {index_, "not valid JSON"}));
  WriteBytes(index_, R"({"metadata": {}})");
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); }, {index_, "\"weight_map\""}));
  WriteIndex({{"a", 3}});
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); },
                         {index_, "\"a\"", "must be a file name string"}));
}

TEST_F(CheckpointIndexTest, RejectsMissingShard) {
  fs::remove(dir_ / f2_);
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); },
                         {index_, f2_, "\"b\"", "is missing"}));
}

TEST_F(CheckpointIndexTest, RejectsTensorAbsentFromItsShard) {
  WriteIndex({{"a", f1_}, {"b", f2_}, {"c", f2_}});
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); },
                         {index_, "\"c\"", f2_, "absent"}));
  WriteIndex({{"a", f2_}, {"b", f2_}});  // "a" is really in the first shard
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); },
                         {index_, "\"a\"", f2_, "absent"}));
}

TEST_F(CheckpointIndexTest, RejectsTensorInTwoFiles) {
  save_safetensors(Path(f2_), {{"b", at::zeros({4})}, {"a", at::zeros({1})}});
  EXPECT_TRUE(ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); },
                         {dir_.string(), "\"a\"", f1_, f2_}));
}

TEST_F(CheckpointIndexTest, RejectsCorruptShard) {
  WriteBytes(dir_ / f1_, "garbage");
  EXPECT_TRUE(
      ThrowsWith([&] { SafetensorsCheckpoint c(dir_.string()); }, {Path(f1_), "file too short"}));
}

}  // namespace
}  // namespace automoe
