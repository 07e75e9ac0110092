package flightdeck.spark;

import java.util.ArrayList;
import java.util.List;
import org.apache.arrow.vector.types.DateUnit;
import org.apache.arrow.vector.types.FloatingPointPrecision;
import org.apache.arrow.vector.types.TimeUnit;
import org.apache.arrow.vector.types.pojo.ArrowType;
import org.apache.arrow.vector.types.pojo.Field;
import org.apache.arrow.vector.types.pojo.FieldType;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.util.ArrowUtils;

/**
 * How Spark reads a stored column. Spark's columnar reader holds only some
 * Arrow types; a dataset written by another Arrow producer (pyarrow,
 * Polars, pandas) may hold others. Each of those that converts without
 * losing values is read as the type Spark's own Parquet reader gives it,
 * and the server casts the column to it before sending:
 *
 * <ul>
 *   <li>unsigned integers widen to the next signed type, {@code uint64} to
 *       {@code decimal(20,0)};
 *   <li>half floats to {@code float}; {@code date64} to {@code date};
 *       {@code decimal256} of precision 38 or less to {@code decimal};
 *   <li>timestamps and durations of any unit to microseconds (what Spark
 *       holds: digits below a microsecond are dropped, as Spark does for
 *       pandas' nanoseconds), times of day to nanoseconds;
 *   <li>fixed-size binary to {@code binary}; large and fixed-size lists to
 *       {@code array}; dictionary-encoded columns to their values;
 *   <li>the same inside lists, structs and maps.
 * </ul>
 *
 * Anything else Spark has no type for (a {@code decimal256} wider than 38
 * digits, a union, a day-time interval) has no readable form: the read
 * refuses it, naming the column.
 */
final class SparkTypes {
  private SparkTypes() {}

  /**
   * A stored column as Spark reads it: {@code field}, the stored field
   * itself where Spark holds it as it is, else the field the server casts
   * it to; and its Spark type.
   */
  record Read(Field field, DataType type) {}

  /** How Spark reads {@code stored}; null where Spark has no type for it. */
  static Read read(Field stored) {
    Field field = readable(stored);
    if (field == null) {
      return null;
    }
    try {
      return new Read(field, ArrowUtils.fromArrowField(field));
    } catch (RuntimeException noSparkType) {
      return null;
    }
  }

  /**
   * The field Spark holds for {@code stored}: {@code stored} itself where
   * Spark holds it as it is; null where Spark has no type for it.
   */
  private static Field readable(Field stored) {
    List<Field> children = new ArrayList<>();
    for (Field child : stored.getChildren()) {
      Field read = readable(child);
      if (read == null) {
        return null;
      }
      children.add(read);
    }
    ArrowType type = readableType(stored.getType(), children);
    if (type == null) {
      return null;
    }
    Field read = new Field(stored.getName(),
        new FieldType(stored.isNullable(), type, null, stored.getMetadata()), children);
    return read.equals(stored) ? stored : read;
  }

  /**
   * The type Spark holds in place of a stored type (given the children as
   * read), or null where it holds none; the stored type where Spark holds it.
   */
  private static ArrowType readableType(ArrowType type, List<Field> children) {
    if (type instanceof ArrowType.Int i && !i.getIsSigned()) {
      return i.getBitWidth() == 64
          ? new ArrowType.Decimal(20, 0, 128)
          : new ArrowType.Int(i.getBitWidth() * 2, true);
    }
    if (type instanceof ArrowType.FloatingPoint f
        && f.getPrecision() == FloatingPointPrecision.HALF) {
      return new ArrowType.FloatingPoint(FloatingPointPrecision.SINGLE);
    }
    if (type instanceof ArrowType.Date d && d.getUnit() == DateUnit.MILLISECOND) {
      return new ArrowType.Date(DateUnit.DAY);
    }
    if (type instanceof ArrowType.Decimal d && d.getBitWidth() != 128) {
      return d.getPrecision() <= 38 ? new ArrowType.Decimal(d.getPrecision(), d.getScale(), 128)
          : null;
    }
    if (type instanceof ArrowType.Timestamp t && t.getUnit() != TimeUnit.MICROSECOND) {
      return new ArrowType.Timestamp(TimeUnit.MICROSECOND, t.getTimezone());
    }
    if (type instanceof ArrowType.Duration d && d.getUnit() != TimeUnit.MICROSECOND) {
      return new ArrowType.Duration(TimeUnit.MICROSECOND);
    }
    if (type instanceof ArrowType.Time t && t.getUnit() != TimeUnit.NANOSECOND) {
      return new ArrowType.Time(TimeUnit.NANOSECOND, 64);
    }
    if (type instanceof ArrowType.FixedSizeBinary) {
      return new ArrowType.Binary();
    }
    if (type instanceof ArrowType.LargeList || type instanceof ArrowType.FixedSizeList) {
      return new ArrowType.List();
    }
    if (type instanceof ArrowType.List || type instanceof ArrowType.Struct
        || type instanceof ArrowType.Map) {
      return type;
    }
    try {
      ArrowUtils.fromArrowType(type);
      return type;
    } catch (RuntimeException noSparkType) {
      return null;
    }
  }

  /**
   * {@code field}'s type as the server's {@code arrow_cast} reads a type
   * name ({@code Timestamp(us, "UTC")}, {@code List(non-null Int64)},
   * {@code Struct("a": Int64)}); for the types {@link #read} gives.
   */
  static String castName(Field field) {
    ArrowType type = field.getType();
    List<Field> children = field.getChildren();
    if (type instanceof ArrowType.Int i) {
      return (i.getIsSigned() ? "Int" : "UInt") + i.getBitWidth();
    }
    if (type instanceof ArrowType.FloatingPoint f) {
      return switch (f.getPrecision()) {
        case HALF -> "Float16";
        case SINGLE -> "Float32";
        case DOUBLE -> "Float64";
      };
    }
    if (type instanceof ArrowType.Decimal d) {
      return "Decimal" + d.getBitWidth() + "(" + d.getPrecision() + ", " + d.getScale() + ")";
    }
    if (type instanceof ArrowType.Date d) {
      return d.getUnit() == DateUnit.DAY ? "Date32" : "Date64";
    }
    if (type instanceof ArrowType.Time t) {
      return "Time" + t.getBitWidth() + "(" + unit(t.getUnit()) + ")";
    }
    if (type instanceof ArrowType.Timestamp t) {
      return "Timestamp(" + unit(t.getUnit())
          + (t.getTimezone() == null ? "" : ", " + quoted(t.getTimezone())) + ")";
    }
    if (type instanceof ArrowType.Duration d) {
      return "Duration(" + unit(d.getUnit()) + ")";
    }
    if (type instanceof ArrowType.Interval i) {
      return "Interval(" + switch (i.getUnit()) {
        case YEAR_MONTH -> "YearMonth";
        case DAY_TIME -> "DayTime";
        case MONTH_DAY_NANO -> "MonthDayNano";
      } + ")";
    }
    if (type instanceof ArrowType.List) {
      return "List(" + nullability(children.get(0)) + castName(children.get(0)) + ")";
    }
    if (type instanceof ArrowType.Struct) {
      return "Struct("
          + String.join(", ", children.stream().map(SparkTypes::namedField).toList()) + ")";
    }
    if (type instanceof ArrowType.Map m) {
      return "Map(" + namedField(children.get(0)) + ", "
          + (m.getKeysSorted() ? "sorted" : "unsorted") + ")";
    }
    String simple = switch (type.getTypeID()) {
      case Null -> "Null";
      case Bool -> "Boolean";
      case Utf8 -> "Utf8";
      case LargeUtf8 -> "LargeUtf8";
      case Utf8View -> "Utf8View";
      case Binary -> "Binary";
      case LargeBinary -> "LargeBinary";
      case BinaryView -> "BinaryView";
      default -> null;
    };
    if (simple == null) {
      throw new IllegalArgumentException("no cast to " + type);
    }
    return simple;
  }

  private static String namedField(Field field) {
    return quoted(field.getName()) + ": " + nullability(field) + castName(field);
  }

  private static String nullability(Field field) {
    return field.isNullable() ? "" : "non-null ";
  }

  private static String quoted(String s) {
    return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"") + "\"";
  }

  private static String unit(TimeUnit unit) {
    return switch (unit) {
      case SECOND -> "s";
      case MILLISECOND -> "ms";
      case MICROSECOND -> "us";
      case NANOSECOND -> "ns";
    };
  }
}
