package flightdeck.spark;

import org.apache.arrow.flight.ErrorFlightMetadata;
import org.apache.arrow.flight.FlightRuntimeException;

/**
 * An error a flightdeck server answered (or reaching it failed), with the
 * gRPC code's name ({@code NOT_FOUND}, {@code FAILED_PRECONDITION}, ...)
 * and the server's message, which says what to do.
 */
public final class FlightDeckException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  /** The gRPC status code's name. */
  public final String code;

  FlightDeckException(String code, String message) {
    super(code + ": " + message);
    this.code = code;
  }

  static FlightDeckException of(FlightRuntimeException e, String location) {
    String message = e.getMessage() == null ? "" : e.getMessage();
    String code = grpcCode(e);
    if (code.equals("UNAVAILABLE") && !message.contains(location)) {
      message = message + " (server " + location + ")";
    }
    FlightDeckException out = new FlightDeckException(code, message);
    out.initCause(e);
    return out;
  }

  /** The trailer in which a flightdeck server sends its error's gRPC code as a number. */
  static final String CODE_TRAILER = "flightdeck-grpc-code";

  /**
   * The gRPC code the server answered with. Flight's own codes fold several
   * into one ({@code FAILED_PRECONDITION}, which says to change something
   * first, arrives as {@code INVALID_ARGUMENT}), so the code the server sent
   * in its trailer is taken where there is one.
   */
  static String grpcCode(FlightRuntimeException e) {
    ErrorFlightMetadata trailers = e.status().metadata();
    String sent = trailers == null ? null : trailers.get(CODE_TRAILER);
    if (sent != null) {
      try {
        return io.grpc.Status.fromCodeValue(Integer.parseInt(sent.trim())).getCode().name();
      } catch (NumberFormatException notANumber) {
        // Not ours: Flight's code below.
      }
    }
    return e.status().code().name();
  }
}
