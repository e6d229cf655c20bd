#pragma once
//! Error codes and the result types that kvkit's fallible operations return.

#include <cassert>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kvkit/config.hpp"

namespace kvkit {

//! Why an operation failed. A failed operation leaves the object it was called on unchanged.
enum class errc : std::uint8_t {
  ok = 0,             //!< no error
  out_of_blocks,      //!< fewer blocks are allocatable than the operation needs
  invalid_block,      //!< the id is not a block of this pool, or the block is not in use
  double_release,     //!< release of a block whose reference count is already zero
  unknown_sequence,   //!< no sequence has this id
  duplicate_sequence, //!< a sequence with this id exists already
  out_of_range,       //!< a length or index is past what the object holds
  buffer_too_small,   //!< a caller-provided output buffer cannot hold the result
  bad_argument,       //!< an argument is outside its documented domain
};

//! A short, stable, human-readable name of an error code.
[[nodiscard]] constexpr std::string_view to_string(errc e) noexcept {
  switch (e) {
  case errc::ok:
    return "ok";
  case errc::out_of_blocks:
    return "out_of_blocks";
  case errc::invalid_block:
    return "invalid_block";
  case errc::double_release:
    return "double_release";
  case errc::unknown_sequence:
    return "unknown_sequence";
  case errc::duplicate_sequence:
    return "duplicate_sequence";
  case errc::out_of_range:
    return "out_of_range";
  case errc::buffer_too_small:
    return "buffer_too_small";
  case errc::bad_argument:
    return "bad_argument";
  }
  return "unknown_error";
}

//! The outcome of an operation that returns nothing on success.
class [[nodiscard]] status {
public:
  constexpr status() noexcept = default;
  constexpr status(errc code) noexcept : code_(code) {} // NOLINT: implicit by design

  [[nodiscard]] constexpr bool ok() const noexcept { return code_ == errc::ok; }
  [[nodiscard]] constexpr explicit operator bool() const noexcept { return ok(); }
  [[nodiscard]] constexpr errc error() const noexcept { return code_; }

  friend constexpr bool operator==(status, status) noexcept = default;

private:
  errc code_ = errc::ok;
};

//! A value of type T, or the error code that explains why there is none.
//!
//! A small stand-in for C++23 std::expected<T, errc>: value() on an error is a precondition
//! violation (checked by assert in debug builds), never an exception.
template <class T>
requires(std::is_nothrow_move_constructible_v<T> &&
         !std::is_reference_v<T>) class [[nodiscard]] result {
public:
  constexpr result(const T& value) noexcept(std::is_nothrow_copy_constructible_v<T>) // NOLINT
      : has_value_(true) {
    std::construct_at(&value_, value);
  }
  constexpr result(T&& value) noexcept : has_value_(true) { // NOLINT
    std::construct_at(&value_, std::move(value));
  }
  //! An error; `error` must not be errc::ok (checked by assert; without asserts it is taken as
  //! errc::bad_argument, so that a result without a value never reports success).
  constexpr result(errc error) noexcept // NOLINT: implicit by design
      : error_(error == errc::ok ? errc::bad_argument : error) {
    assert(error != errc::ok);
  }
  constexpr result(const result& other) noexcept(std::is_nothrow_copy_constructible_v<T>)
      : has_value_(other.has_value_), error_(other.error_) {
    if (has_value_) {
      std::construct_at(&value_, other.value_);
    }
  }
  constexpr result(result&& other) noexcept : has_value_(other.has_value_), error_(other.error_) {
    if (has_value_) {
      std::construct_at(&value_, std::move(other.value_));
    }
  }
  result& operator=(const result&) = delete;
  result& operator=(result&&) = delete;
  constexpr ~result() {
    if (has_value_) {
      std::destroy_at(&value_);
    }
  }

  [[nodiscard]] constexpr bool has_value() const noexcept { return has_value_; }
  [[nodiscard]] constexpr bool ok() const noexcept { return has_value_; }
  [[nodiscard]] constexpr explicit operator bool() const noexcept { return has_value_; }
  //! errc::ok when a value is held.
  [[nodiscard]] constexpr errc error() const noexcept { return error_; }
  //! The outcome without the value.
  [[nodiscard]] constexpr kvkit::status status() const noexcept { return error_; }

  //! The value; there must be one (checked by assert).
  [[nodiscard]] constexpr T& value() & noexcept {
    assert(has_value_);
    return value_;
  }
  [[nodiscard]] constexpr const T& value() const& noexcept {
    assert(has_value_);
    return value_;
  }
  [[nodiscard]] constexpr T&& value() && noexcept {
    assert(has_value_);
    return std::move(value_);
  }
  [[nodiscard]] constexpr T& operator*() & noexcept { return value(); }
  [[nodiscard]] constexpr const T& operator*() const& noexcept { return value(); }
  [[nodiscard]] constexpr T* operator->() noexcept { return &value(); }
  [[nodiscard]] constexpr const T* operator->() const noexcept { return &value(); }

  //! The value, or `fallback` converted to T when there is none.
  template <class U>
  requires std::constructible_from<T, U&&>
  [[nodiscard]] constexpr T value_or(U&& fallback) const& {
    return has_value_ ? value_ : static_cast<T>(std::forward<U>(fallback));
  }

private:
  bool has_value_ = false;
  errc error_ = errc::ok;
  union {
    T value_;
  };
};

} // namespace kvkit
