package flightdeck.spark;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Set;
import org.apache.spark.sql.sources.And;
import org.apache.spark.sql.sources.EqualTo;
import org.apache.spark.sql.sources.Filter;
import org.apache.spark.sql.sources.GreaterThan;
import org.apache.spark.sql.sources.GreaterThanOrEqual;
import org.apache.spark.sql.sources.In;
import org.apache.spark.sql.sources.IsNotNull;
import org.apache.spark.sql.sources.IsNull;
import org.apache.spark.sql.sources.LessThan;
import org.apache.spark.sql.sources.LessThanOrEqual;
import org.apache.spark.sql.sources.Not;
import org.apache.spark.sql.sources.Or;
import org.apache.spark.sql.types.BooleanType;
import org.apache.spark.sql.types.ByteType;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.IntegerType;
import org.apache.spark.sql.types.LongType;
import org.apache.spark.sql.types.ShortType;
import org.apache.spark.sql.types.StringType;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;

/**
 * Spark's data source filters as the SQL condition of a read plan, for the
 * filters whose meaning is the same on the server: comparisons, {@code IN},
 * null tests and their {@code AND}/{@code OR}/{@code NOT} over top-level
 * integer, string and boolean columns. Floating-point and temporal columns
 * are left to Spark (NaN, signed zero and literal formats differ), and so
 * is any filter with a part that does not translate.
 */
final class Filters {
  private Filters() {}

  /** {@code filters} that translate, and the SQL of each. */
  record Pushed(List<Filter> filters, List<String> sqls) {
    static final Pushed NONE = new Pushed(List.of(), List.of());

    /** The SQL of every filter, joined with AND ("" for none). */
    String sql() {
      return String.join(" AND ", sqls);
    }

    /** The filters that name none of {@code columns}. */
    Pushed without(Set<String> columns) {
      List<Filter> kept = new ArrayList<>();
      List<String> keptSql = new ArrayList<>();
      for (int i = 0; i < filters.size(); i++) {
        if (Arrays.stream(filters.get(i).references()).noneMatch(columns::contains)) {
          kept.add(filters.get(i));
          keptSql.add(sqls.get(i));
        }
      }
      return new Pushed(kept, keptSql);
    }
  }

  /** The part of {@code filters} (a conjunction) that the server can evaluate. */
  static Pushed push(Filter[] filters, StructType schema) {
    List<Filter> pushed = new ArrayList<>();
    List<String> sql = new ArrayList<>();
    for (Filter f : filters) {
      String s = sql(f, schema);
      if (s != null) {
        pushed.add(f);
        sql.add(s);
      }
    }
    return new Pushed(pushed, sql);
  }

  /** {@code f} as SQL with the same rows selected, or null. */
  static String sql(Filter f, StructType schema) {
    if (f instanceof And a) {
      return both(sql(a.left(), schema), "AND", sql(a.right(), schema));
    }
    if (f instanceof Or o) {
      return both(sql(o.left(), schema), "OR", sql(o.right(), schema));
    }
    if (f instanceof Not n) {
      String inner = sql(n.child(), schema);
      return inner == null ? null : "(NOT " + inner + ")";
    }
    if (f instanceof IsNull n) {
      return column(n.attribute(), schema, true) == null
          ? null : "(" + quote(n.attribute()) + " IS NULL)";
    }
    if (f instanceof IsNotNull n) {
      return column(n.attribute(), schema, true) == null
          ? null : "(" + quote(n.attribute()) + " IS NOT NULL)";
    }
    if (f instanceof EqualTo c) {
      return compare(c.attribute(), "=", c.value(), schema);
    }
    if (f instanceof GreaterThan c) {
      return compare(c.attribute(), ">", c.value(), schema);
    }
    if (f instanceof GreaterThanOrEqual c) {
      return compare(c.attribute(), ">=", c.value(), schema);
    }
    if (f instanceof LessThan c) {
      return compare(c.attribute(), "<", c.value(), schema);
    }
    if (f instanceof LessThanOrEqual c) {
      return compare(c.attribute(), "<=", c.value(), schema);
    }
    if (f instanceof In in) {
      DataType type = column(in.attribute(), schema, false);
      if (type == null || in.values().length == 0) {
        return null;
      }
      List<String> values = new ArrayList<>();
      for (Object v : in.values()) {
        String literal = literal(v, type);
        if (literal == null) {
          return null;
        }
        values.add(literal);
      }
      return "(" + quote(in.attribute()) + " IN (" + String.join(", ", values) + "))";
    }
    return null;
  }

  private static String both(String left, String op, String right) {
    return left == null || right == null ? null : "(" + left + " " + op + " " + right + ")";
  }

  private static String compare(String attribute, String op, Object value, StructType schema) {
    DataType type = column(attribute, schema, false);
    String literal = type == null ? null : literal(value, type);
    return literal == null ? null : "(" + quote(attribute) + " " + op + " " + literal + ")";
  }

  /**
   * The type of top-level column {@code name}, if it is one whose
   * comparisons translate ({@code anyType}: any column, for null tests).
   */
  private static DataType column(String name, StructType schema, boolean anyType) {
    for (StructField field : schema.fields()) {
      if (field.name().equals(name)) {
        DataType t = field.dataType();
        boolean simple = t instanceof ByteType || t instanceof ShortType
            || t instanceof IntegerType || t instanceof LongType
            || t instanceof StringType || t instanceof BooleanType;
        return anyType || simple ? t : null;
      }
    }
    return null; // a nested field, or a name Spark quoted
  }

  /** {@code v} as a SQL literal of a column of {@code type}, or null. */
  private static String literal(Object v, DataType type) {
    if (type instanceof StringType) {
      return v instanceof String s ? "'" + s.replace("'", "''") + "'" : null;
    }
    if (type instanceof BooleanType) {
      return v instanceof Boolean b ? (b ? "TRUE" : "FALSE") : null;
    }
    boolean integral = v instanceof Byte || v instanceof Short || v instanceof Integer
        || (v instanceof Long l && l != Long.MIN_VALUE); // (its digits overflow before the minus)
    return integral ? v.toString() : null;
  }

  /** A column name as a SQL identifier (case kept, quotes doubled). */
  static String quote(String name) {
    return "\"" + name.replace("\"", "\"\"") + "\"";
  }
}
